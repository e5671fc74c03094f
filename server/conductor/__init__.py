"""The conductor: KVCache-aware request scheduling over prefill and decode workers."""

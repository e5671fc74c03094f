"""``mooncake`` as kvstore serves it: ``mooncake.store`` is kvstore_client.compat.mooncake (see there)."""

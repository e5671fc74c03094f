"""Transfer engine: moves frames and block bytes between clients, daemons and the master.

Blocking and asyncio frame I/O over TCP, zero-copy in both directions; the
UCX and shared-memory transports and multi-NIC slicing come with the
Transfer engine issue behind the same calls.
"""

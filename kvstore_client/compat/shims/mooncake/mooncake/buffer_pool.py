"""Mooncake's ``mooncake.buffer_pool``, served by kvstore (kvstore_client.compat.buffer_pool)."""

from kvstore_client.compat.buffer_pool import BufferLease, BufferPool, RegisteredBufferPool

__all__ = ["BufferLease", "BufferPool", "RegisteredBufferPool"]

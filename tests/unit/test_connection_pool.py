"""The one connection pool (transfer.rpc.ConnectionPool), bounded and not. Connections open lazily,
so no peer is needed to check who waits and what is kept."""

from __future__ import annotations

import pytest

from kvstore.errors import Timeout
from transfer.rpc import ConnectionPool


def test_a_bounded_pool_makes_a_caller_wait_for_a_free_connection() -> None:
    pool = ConnectionPool("127.0.0.1:1", timeout=0.01, size=1)
    held = pool.acquire()
    with pytest.raises(Timeout, match="no free connection"):
        pool.acquire()
    pool.release(held)
    assert pool.acquire() is held  # the idle one is handed out again


def test_an_unbounded_pool_opens_more_and_keeps_only_size_idle() -> None:
    pool = ConnectionPool("127.0.0.1:1", timeout=0.01, size=2, bounded=False)
    conns = [pool.acquire() for _ in range(5)]  # nobody waits
    assert len({id(c) for c in conns}) == 5
    for conn in conns:
        pool.release(conn)
    assert [pool.acquire() for _ in range(2)] == conns[1::-1]  # the first two given back (the rest closed), last first
    pool.close()
    fresh = pool.acquire()
    pool.release(fresh)  # given back after close: closed, not kept
    assert pool.acquire() is not fresh

"""The daemon's book of grants, alone: claims, owners, expiry by the time it is given, and an end
that waits for writes in flight and cached puts' commits, and cuts a writer that stalls."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvstore.errors import GrantExpired, InvalidArgument, PermissionDenied, Timeout
from server.daemon.grants import STALE_S, Grants

A = 4096


def book() -> Grants:
    grants = Grants(capacity=1 << 20, alignment=A)
    grants.open(1, 0, 16 * A, ttl_ms=1000, owner="", now=0.0)
    return grants


def test_a_grant_opens_once_inside_the_arena_and_aligned() -> None:
    grants = book()
    grants.open(1, 0, 16 * A, ttl_ms=1000, owner="", now=0.0)  # again, same extent: fine
    with pytest.raises(InvalidArgument, match="another extent"):
        grants.open(1, A, 16 * A, ttl_ms=1000, owner="", now=0.0)
    for offset, length in ((-A, A), (1, A), (0, 0), (1 << 20, A)):
        with pytest.raises(InvalidArgument, match="outside the arena or misaligned"):
            grants.open(2, offset, length, ttl_ms=1000, owner="", now=0.0)
    # An expired grant whose end never came is forgotten when a later one opens.
    grants.open(3, 32 * A, A, ttl_ms=1000, owner="", now=STALE_S + 5)
    assert grants.ids() == [3]


def test_writes_claim_free_extents_of_their_grant_only() -> None:
    grants = book()
    a, _ = socket.socketpair()
    grant, refused = grants.begin_write(1, None, ["x", "y", "z", "w"], [0, A, 100, 15 * A], [A, 10, A, 2 * A], a, 0.5)
    assert grant is not None
    assert [type(r).__name__ if r else None for r in refused] == [None, None, "InvalidArgument", "InvalidArgument"]
    again, refused = grants.begin_write(1, None, ["v"], [A], [A], a, 0.5)  # claimed before: never twice
    assert again is grant and isinstance(refused[0], InvalidArgument)
    grants.end_write(grant, a)
    grants.end_write(grant, a)
    assert grant.active == 0 and not grant.receivers
    a.close()


def test_a_grant_takes_no_write_of_another_tenant_nor_after_its_deadline() -> None:
    grants = Grants(1 << 20, A)
    grants.open(7, 0, 4 * A, ttl_ms=1000, owner="alice", now=0.0)
    a, _ = socket.socketpair()
    grant, refused = grants.begin_write(7, "bob", ["k"], [0], [A], a, 0.1)
    assert grant is None and isinstance(refused[0], PermissionDenied)
    grant, refused = grants.begin_write(7, "alice", ["k"], [0], [A], a, 1.5)
    assert grant is None and isinstance(refused[0], GrantExpired)
    grant, refused = grants.begin_write(8, None, ["k"], [0], [A], a, 0.1)
    assert grant is None and isinstance(refused[0], GrantExpired)
    a.close()


def test_an_end_waits_for_writes_and_cached_commits_and_cuts_a_writer_that_stalls() -> None:
    grants = book()
    a, _ = socket.socketpair()
    grant, _ = grants.begin_write(1, None, ["x"], [0], [A], a, 0.1)
    assert grant is not None
    held = grants.hold(1)
    assert held is grant and grants.hold(99) is None
    cut: list[socket.socket] = []

    def finish() -> None:
        time.sleep(0.05)
        grants.end_write(grant, a)
        time.sleep(0.05)
        grants.release(held)

    threading.Thread(target=finish).start()
    start = time.monotonic()
    assert grants.end([1], cut.append, wait_s=1.0) == [True]
    assert 0.09 < time.monotonic() - start < 1.0 and cut == [] and grants.ids() == []
    # Without cached: only writes in flight count. A writer that stalls is cut, then given up on.
    grants.open(2, 0, 4 * A, ttl_ms=1000, owner="", now=0.0)
    stuck, _ = grants.begin_write(2, None, ["y"], [0], [A], a, 0.1)
    assert stuck is not None and grants.hold(2) is stuck
    with pytest.raises(Timeout, match="did not stop"):
        grants.end([2], cut.append, wait_s=0.05, cached=False, patience_s=0.05)
    assert cut == [a]
    grants.end_write(stuck, a)
    assert grants.end([2], cut.append, wait_s=0.05, cached=False, patience_s=0.05) == [True]
    a.close()

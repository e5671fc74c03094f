"""Orphans (issue 27): a block written after the master gave its put up is found and dropped by the
daemon's reconciliation with the master, and puts the master places over it meanwhile are retried,
not refused. Real master and daemon processes; the orphan is made as a slow writer makes one: the
put's reservation revoked (its drop answered) before its bytes reach the daemon."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest

from bench.frames import ask
from kvstore.errors import RetryLater
from kvstore.keys import checksum
from kvstore.protocol import OkReply, PutRevoke, PutStart, PutStartReply, WriteBlocks, WriteReply
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from kvstore_client.dataplane import DataPath
from transfer.rpc import ConnectionPool

MiB = 1024 * 1024


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(1, dram="8MiB", admin=True) as c:
        yield c


def _orphan(cluster: LocalCluster, key: str, size: int) -> int:
    """Write ``key`` to the daemon after its put was revoked; its DRAM offset."""
    reply = ask(cluster.master_address, PutStart([key], [size], 1, None, False))
    assert isinstance(reply, PutStartReply)
    [ticket] = reply.tickets()
    [replica] = ticket.replicas
    assert ask(cluster.master_address, PutRevoke([key])) == OkReply()
    time.sleep(0.3)  # the master's drop reached the daemon (nothing to drop yet) and was answered
    data = bytes([7]) * size
    written = ask(replica.address, WriteBlocks([key], [replica.offset], [size], [checksum(data)], False), payload=data)
    assert isinstance(written, WriteReply) and written.codes == [0], written
    return replica.offset


def _metric(cluster: LocalCluster, prefix: str) -> float:
    with urllib.request.urlopen(f"http://{cluster.admin_address}/metrics", timeout=10) as r:
        lines = [line for line in r.read().decode().splitlines() if line.startswith(prefix)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_an_orphan_is_dropped_and_puts_over_it_succeed(cluster: LocalCluster) -> None:
    _orphan(cluster, "late", 1 * MiB)
    with Store.connect(cluster.master_address, cluster.client_config(transport="tcp", timeout_s=5.0)) as s:
        # Fill the node: the master hands the orphan's extent out again, as it believes it free.
        for i in range(12):
            deadline = time.monotonic() + 10
            while True:
                try:
                    s.put(f"fill-{i}", bytes([i]) * MiB)
                    break
                except RetryLater:
                    assert time.monotonic() < deadline, f"fill-{i} was refused for 10 s"
                    time.sleep(0.2)
        assert [s.get(f"fill-{i}") for i in range(9, 12)] == [bytes([i]) * MiB for i in range(9, 12)]
    deadline = time.monotonic() + 10
    while _metric(cluster, 'kvstore_daemon_refusals_total{kind="orphans_dropped"') < 1:
        assert time.monotonic() < deadline, "the daemon never dropped the orphan"
        time.sleep(0.25)
    assert _metric(cluster, "kvstore_orphans_total") >= 1


def _by_key(address: str, key: str) -> bytes | None:
    """``key`` as its daemon serves it to a reader that came by key alone (a hinted read)."""
    pool = ConnectionPool(address, 5.0, 1)
    try:
        [found], [made] = DataPath("direct", address, pool).read_direct([key], [None])
    finally:
        pool.close()
    return None if found is None or made is None else bytes(made)


def test_a_late_write_is_never_served_and_a_two_trip_put_is_served_once_vouched_for(cluster: LocalCluster) -> None:
    """Served orphans (issue 40): the bytes of a put the master gave up land all the same; a reader
    by key alone must not get them (the orphan check drops them seconds later). A two-trip put's
    own block is served by key once a reader the master sent has read it at its extent."""
    [daemon] = cluster.daemon_addresses
    _orphan(cluster, "late", 64 * 1024)
    assert _by_key(daemon, "late") is None  # served to any hinted reader before (issue 40)
    config = cluster.client_config(transport="tcp", timeout_s=5.0, grant_bytes=0)  # every put two trips
    with Store.connect(cluster.master_address, config) as s:
        assert s.get("late") is None  # the master knows no such put
        assert s.put("mine", b"m" * 4096).value == "stored"
        assert _by_key(daemon, "mine") is None  # the master's word not yet heard here
        assert s.get("mine") == b"m" * 4096  # its hint missed; the master sent the read to its extent
        assert _by_key(daemon, "mine") == b"m" * 4096  # vouched for from then on


def test_a_one_trip_put_over_an_orphan_is_stored_not_answered_exists(cluster: LocalCluster) -> None:
    """A grant's write of a key whose block here is a late write the master never committed: not
    EXISTS (the master knows no such key, so the put would claim bytes nobody can read); the put goes
    the two-trip way, the orphan is asked about at once and dropped, and the put stores."""
    _orphan(cluster, "over", 64 * 1024)
    with Store.connect(cluster.master_address, cluster.client_config(transport="tcp", timeout_s=5.0)) as s:
        assert s.put("over", b"n" * 4096).value == "stored"
        assert s.get("over") == b"n" * 4096

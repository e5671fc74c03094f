"""A block with two replicas reads from the second when the first's daemon is killed or stalled, through
either face of the client (Store and AsyncStore share one core, so one failover)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.config import ClientConfig
from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import PutOptions, Store
from tests.conftest import FACES, connect_client

KB = 1024
# The master keeps listing a silent node's replicas for this long: the client meets the dead one.
SLOW_TTL = ("--node-ttl-ms", "120000")
# Over the network: a same-host client would copy a dead daemon's blocks from its arena.
TCP = ClientConfig(transport="tcp")


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="8MiB", master_args=SLOW_TTL) as c:
        yield c


def put_twice(cluster: LocalCluster, name: str) -> tuple[list[str], list[bytes], int]:
    """Blocks stored on both nodes; returns them and the index of the daemon the first block's
    first replica is on (the one a reader without hints asks first)."""
    data = [bytes(row) for row in np.random.default_rng(7).integers(0, 256, (8, 16 * KB), dtype=np.uint8)]
    keys = [f"{name}-{i}" for i in range(len(data))]
    with Store.connect(cluster.master_address, TCP) as writer:
        writer.put_many(zip(keys, data, strict=True), PutOptions(replicas=2))
        with writer._located(keys) as located:
            assert all(loc is not None and len(loc.replicas) == 2 for loc in located)
            first = located[0].replicas[0].node_id if located[0] is not None else ""
    return keys, data, [cluster.node_name(i) for i in range(2)].index(first)


@pytest.mark.parametrize("face", FACES)
def test_a_killed_first_replica_is_read_from_the_second(cluster: LocalCluster, face: str) -> None:
    keys, data, first = put_twice(cluster, f"killed-{face}")
    cluster.kill_daemon(first)
    with connect_client(face, cluster.master_address, TCP) as reader:  # no hints: where the master says
        assert reader.get_many(keys, verify=True) == data
        out = np.zeros((len(keys), 16 * KB), dtype=np.uint8)
        assert reader.get_many_into(keys, list(out), verify=True) == [16 * KB] * len(keys)
        assert [bytes(row) for row in out] == data
        part = np.zeros((len(keys), 100), dtype=np.uint8)
        assert reader.get_range_many_into(keys, 1000, 100, list(part)) == [100] * len(keys)
        assert [bytes(row) for row in part] == [d[1000:1100] for d in data]


@pytest.mark.parametrize("face", FACES)
def test_a_stalled_first_replica_times_out_and_is_read_from_the_second(cluster: LocalCluster, face: str) -> None:
    keys, data, first = put_twice(cluster, f"stalled-{face}")
    daemon = cluster.daemons[first]
    assert daemon is not None
    daemon.send_signal(signal.SIGSTOP)  # it accepts connections (the kernel does) and never answers
    try:
        with connect_client(face, cluster.master_address, ClientConfig(transport="tcp", timeout_s=1.0)) as reader:
            assert reader.get_many(keys, verify=True) == data
    finally:
        daemon.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("face", FACES)
def test_a_frozen_replica_is_given_up_after_the_failover_patience_not_the_timeout(
    cluster: LocalCluster, face: str
) -> None:
    """The client's timeout is 30 s; a read from a frozen node (hinted by key, then located) goes on
    to the next replica after ``failover_ms``. The bound below is half the timeout: only a read that
    waited out the timeout fails it, however busy the machine."""
    keys, data, first = put_twice(cluster, f"frozen-{face}")
    daemon = cluster.daemons[first]
    assert daemon is not None
    config = ClientConfig(transport="tcp", timeout_s=30.0, failover_ms=100)
    with connect_client(face, cluster.master_address, config) as reader:
        assert reader.get_many(keys, verify=True) == data  # hints: the first replica of each, now
        daemon.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            assert reader.get_many(keys, verify=True) == data  # by hint, then where the master says
            assert [reader.get(k) for k in keys[:2]] == data[:2]
            assert time.monotonic() - began < 15.0
        finally:
            daemon.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("face", FACES)
def test_after_a_node_failed_a_read_its_single_copies_miss_at_once(cluster: LocalCluster, face: str) -> None:
    """Blocks with one copy on a frozen node: the first read, past its patience, asks the master,
    which suspects the node once it missed three heartbeats, and misses; from then on (for a second,
    or until it answers) the client suspects that node, so another such block is a miss within the
    failover patience, not a whole timeout; blocks with a copy elsewhere are read there."""
    node = cluster.node_name(0)
    daemon = cluster.daemons[0]
    assert daemon is not None
    with Store.connect(cluster.master_address, TCP) as writer:
        for i in range(3):
            writer.put(f"alone-{face}-{i}", b"a" * 4096, PutOptions(preferred_node=node))
    keys, data, _ = put_twice(cluster, f"paired-{face}")
    timeout = 3.0
    with connect_client(face, cluster.master_address, ClientConfig(transport="tcp", timeout_s=timeout)) as reader:
        daemon.send_signal(signal.SIGSTOP)
        try:
            assert reader.get(f"alone-{face}-0") is None  # the master suspects the node: so does the client now
            began = time.monotonic()
            assert reader.get(f"alone-{face}-1") is None
            assert reader.get_many([f"alone-{face}-2", *keys], verify=True) == [None, *data]
            assert time.monotonic() - began < timeout / 2
        finally:
            daemon.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("face", FACES)
def test_a_two_trip_put_to_a_frozen_node_is_put_again_elsewhere_not_after_the_timeout(face: str) -> None:
    """A write the master reserved on a node that then froze: the client gives it up once its daemon
    has not answered within the write patience (200 ms and the bytes at 100 MB/s), revokes and puts
    it again, elsewhere (it names the node to the master as one it could not reach). The client's
    timeout is 30 s: only a put that waited it out fails the half-timeout bound below."""
    with LocalCluster(2, dram="8MiB") as cluster:  # the default node TTL: the frozen node is fenced
        frozen = cluster.node_name(0)
        daemon = cluster.daemons[0]
        assert daemon is not None
        data = [bytes([i]) * 4096 for i in range(4)]
        keys = [f"two-trip-{face}-{i}" for i in range(len(data))]
        config = ClientConfig(transport="tcp", timeout_s=30.0, grant_bytes=0)  # every put two trips
        with connect_client(face, cluster.master_address, config) as writer:
            assert writer.put("warm", b"w" * 4096, PutOptions(preferred_node=frozen)).value == "stored"
            daemon.send_signal(signal.SIGSTOP)
            try:
                began = time.monotonic()
                statuses = writer.put_many(zip(keys, data, strict=True), PutOptions(preferred_node=frozen))
                assert [s.value for s in statuses] == ["stored"] * len(keys)
                assert time.monotonic() - began < 15.0
                assert writer.get_many(keys, verify=True) == data  # from the node that took them
            finally:
                daemon.send_signal(signal.SIGCONT)

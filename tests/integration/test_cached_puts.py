"""``cached`` puts (issue 39): STORED once the bytes are checked and committed in the daemon's arena,
the master told after. On a real cluster (a master and two daemons, processes on loopback): the
writer reads its block at once and every client after ``flush``; a commit the master refuses
(another writer's block under the key) drops the daemon's copy and every reader gets the stored
block; a daemon killed while the master could not hear of its acknowledged puts brings them back
with its inventory."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kvstore.config import ClientConfig
from kvstore.results import PutStatus
from kvstore_cli.cluster import LocalCluster
from kvstore_client import PutOptions, Store
from tests.conftest import FACES, connect_client

CACHED = ClientConfig(transport="tcp", put_mode="cached")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="64MiB", daemon_metrics=True) as c:
        yield c


def daemon_metric(cluster: LocalCluster, i: int, name: str) -> float:
    with urllib.request.urlopen(f"http://{cluster.daemon_metrics[i]}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"kvstore_daemon_{name}"))


@pytest.mark.parametrize("face", FACES)
def test_a_cached_put_reads_at_once_for_its_writer_and_for_everyone_after_flush(
    face: str, cluster: LocalCluster
) -> None:
    with connect_client(face, cluster.master_address, CACHED) as writer, Store.connect(cluster.master_address) as other:
        blocks = {f"{face}-cached-{i}": bytes([i]) * (4096 + i) for i in range(20)}
        for key, data in blocks.items():
            assert writer.put(key, data) is PutStatus.STORED
            assert writer.get(key) == data  # the writer reads it at once, from the node it wrote
        assert (
            writer.put_many(list({f"{face}-batch-{i}": b"b" * 300 for i in range(8)}.items())) == [PutStatus.STORED] * 8
        )
        writer.flush()
        assert other.exists_many(list(blocks)) == [True] * len(blocks)  # every client, once flushed
        assert other.get_many(list(blocks)) == list(blocks.values())
        assert other.exists_many([f"{face}-batch-{i}" for i in range(8)]) == [True] * 8
        writer.flush()  # nothing left to wait for


def test_a_visible_put_is_the_default_and_a_put_may_ask_for_either(cluster: LocalCluster) -> None:
    with (
        Store.connect(cluster.master_address, ClientConfig(transport="tcp")) as writer,
        Store.connect(cluster.master_address) as other,
    ):
        assert writer.put("mode-visible", b"v" * 5000) is PutStatus.STORED
        assert other.exists("mode-visible")  # at once: visible mode waits for the master
        assert writer.put("mode-cached", b"c" * 5000, PutOptions(mode="cached")) is PutStatus.STORED
        writer.flush()
        assert other.get("mode-cached") == b"c" * 5000
    with pytest.raises(Exception, match="mode"):
        PutOptions(mode="eventually")


def test_a_cached_put_the_master_refuses_is_dropped_and_readers_get_the_stored_block(cluster: LocalCluster) -> None:
    """Another writer's block is under the key on the other node: the daemon acknowledged the cached
    put (it could not know), the master refuses its commit, the daemon drops its copy and counts
    it; every reader, the writer too, then reads the block the store keeps."""
    with Store.connect(cluster.master_address, ClientConfig(transport="tcp")) as first:
        assert first.put("contested", b"first" * 1000) is PutStatus.STORED
        place = first._core.hints.get("contested")
        assert place is not None
    node_ids = [n.node_id for n in first_nodes(cluster)]
    other_node = next(n for n in node_ids if n != place[0])
    index = node_ids.index(other_node)
    refused_before = daemon_metric(cluster, index, "cached_refused")
    with Store.connect(cluster.master_address, CACHED) as writer:
        # Into a grant on the other node: that daemon does not hold the key, so it acknowledges.
        status = writer.put_many([("contested", b"second" * 1000)], PutOptions(preferred_node=other_node))
        assert status == [PutStatus.STORED]
        writer.flush()
        assert daemon_metric(cluster, index, "cached_refused") == refused_before + 1
        assert writer.get("contested") == b"first" * 1000
    with Store.connect(cluster.master_address) as reader:
        assert reader.get("contested") == b"first" * 1000


def first_nodes(cluster: LocalCluster) -> list:  # type: ignore[type-arg]
    with Store.connect(cluster.master_address) as s:
        nodes = sorted(s.nodes(), key=lambda n: n.node_id)
    assert [n.node_id for n in nodes] == [cluster.node_name(i) for i in range(len(nodes))]
    return nodes


def test_a_daemon_killed_before_the_master_heard_brings_its_acknowledged_puts_back(cluster: LocalCluster) -> None:
    """The master stopped (SIGSTOP): cached puts are acknowledged, their commits cannot go out; the
    daemon is killed and started again, the master continued: the blocks come back with the
    daemon's inventory, each with the writer's bytes."""
    with Store.connect(cluster.master_address, CACHED) as writer:
        assert writer.put("warm", b"w" * 100) is PutStatus.STORED  # a grant in hand
        place = writer._core.hints.get("warm")
        assert place is not None
        index = [cluster.node_name(i) for i in range(2)].index(place[0])
        assert cluster.master is not None
        cluster.master.send_signal(signal.SIGSTOP)
        try:
            blocks = {f"unheard-{i}": bytes([i]) * 3000 for i in range(5)}
            for key, data in blocks.items():
                assert writer.put(key, data) is PutStatus.STORED
                assert writer.get(key) == data
            cluster.kill_daemon(index)
        finally:
            cluster.master.send_signal(signal.SIGCONT)
    cluster.restart_daemon(index)
    cluster.wait_for_nodes(2)
    with Store.connect(cluster.master_address) as reader:
        deadline = time.monotonic() + 20
        while reader.exists_many(list(blocks)) != [True] * len(blocks):
            assert time.monotonic() < deadline, reader.exists_many(list(blocks))
            time.sleep(0.2)
        assert reader.get_many(list(blocks)) == list(blocks.values())

"""A daemon whose process is gone is fenced at once, not after the node TTL: the master finds its
port refusing connections when one of its commands to the node fails, when a client reports the
node unreachable, or when the node missed two heartbeats. A frozen daemon (the kernel still
accepts its connections) is never fenced that way: it may still serve. Checked with real processes
and a node TTL of a minute, so that a fence within the test can only be the early one. A frozen
one that missed heartbeats is suspected instead: new blocks go elsewhere until it heartbeats again."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from bench.frames import ask
from kvstore.config import ClientConfig
from kvstore.errors import Timeout
from kvstore.protocol import GetReplicas, GetReplicasReply, OkReply, ReportNode, Stats, StatsReply
from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import PutOptions, Store

TTL_MS = 60_000
SLOW_HEARTBEATS = ("--node-ttl-ms", str(TTL_MS), "--heartbeat-ms", "20000")
"""Heartbeats every 20 s: neither the TTL nor two missed heartbeats come within a test."""
TCP = ClientConfig(transport="tcp", timeout_s=5.0)


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    extra = getattr(request, "param", ())
    with LocalCluster(2, dram="8MiB", master_args=(*SLOW_HEARTBEATS, *extra)) as c:
        yield c


def stats(cluster: LocalCluster) -> dict[str, int | float]:
    reply = ask(cluster.master_address, Stats())
    assert isinstance(reply, StatsReply)
    return reply.stats


def up(store: Store, node: str) -> bool:
    return next(n.up for n in store.nodes() if n.node_id == node)


def wait_down(store: Store, node: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while up(store, node):
        assert time.monotonic() < deadline, f"{node} still up after {within_s} s"
        time.sleep(0.05)


def test_a_remove_on_a_killed_node_is_answered_once_the_master_finds_it_gone(cluster: LocalCluster) -> None:
    """The remove's drop to the dead daemon fails; the master's probe is refused, so it fences the
    node and the remove is answered (with the fence at the TTL it answered Timeout: a minute away)."""
    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("k", b"v" * 4096, PutOptions(replicas=2)).value == "stored"
        cluster.kill_daemon(0)
        assert store.remove("k")
        assert not up(store, cluster.node_name(0))
        assert store.put("k", b"w" * 4096).value == "stored"  # placed on the live node
        assert store.get("k") == b"w" * 4096
    counted = stats(cluster)
    assert counted["fences_refused"] == counted["fences"] == 1


@pytest.mark.parametrize("cluster", [("--no-fence-refused",)], indirect=True)
def test_without_fence_refused_the_remove_waits_for_the_ttl(cluster: LocalCluster) -> None:
    """What the test above would see without the probe's fence (the check fails on the old code)."""
    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("k", b"v" * 4096, PutOptions(replicas=2)).value == "stored"
        cluster.kill_daemon(0)
        with pytest.raises(Timeout):
            store.remove("k")
        assert up(store, cluster.node_name(0))
    assert stats(cluster)["fences"] == 0


def test_a_clients_report_of_a_killed_node_fences_it(cluster: LocalCluster) -> None:
    """No master command goes to the node: the client's get, refused by the dead daemon, reports it."""
    node = cluster.node_name(0)
    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("only-there", b"v" * 4096, PutOptions(preferred_node=node)).value == "stored"
        cluster.kill_daemon(0)
        assert store.get("only-there") is None  # its one copy is on the dead node: a miss
        wait_down(store, node, within_s=10.0)  # the report's probe; no heartbeat is missed for 40 s
    assert stats(cluster)["fences_refused"] == 1


def test_a_frozen_node_is_not_fenced_by_reports(cluster: LocalCluster) -> None:
    """A frozen daemon may still serve (it thaws within its lease): its port does not refuse, so
    reports of it, however many, leave it up; the TTL fences it if it stays silent."""
    daemon = cluster.daemons[0]
    assert daemon is not None
    node = cluster.node_name(0)
    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("k", b"v" * 4096, PutOptions(preferred_node=node)).value == "stored"
        daemon.send_signal(signal.SIGSTOP)
        try:
            for _ in range(5):
                assert isinstance(ask(cluster.master_address, ReportNode(node)), OkReply)
                time.sleep(0.3)  # past the probe's gap and its timeout: each report probes
            assert up(store, node)
        finally:
            daemon.send_signal(signal.SIGCONT)
        assert store.get("k") == b"v" * 4096
        assert isinstance(ask(cluster.master_address, ReportNode("no-such-node")), OkReply)
    assert stats(cluster)["fences"] == 0


def test_a_killed_node_that_misses_two_heartbeats_is_fenced_without_any_client() -> None:
    with LocalCluster(2, dram="8MiB", master_args=("--node-ttl-ms", str(TTL_MS), "--heartbeat-ms", "200")) as c:
        c.kill_daemon(0)
        with Store.connect(c.master_address, TCP) as store:
            wait_down(store, c.node_name(0), within_s=20.0)  # the TTL is a minute away
        assert stats(c)["fences_refused"] == 1


def test_a_frozen_node_is_suspected_and_new_blocks_go_elsewhere_until_it_heartbeats() -> None:
    """A frozen daemon misses two heartbeats and does not answer the master's probe: the master
    suspects it and places new blocks on the others first, even a put that prefers it (a put placed
    there waited out its write patience, was put again there, and so on until the fence: a minute
    here; a client that gave the node up names it to avoid since, but this checks the master's own
    view, with a client new to the node). Its first heartbeat after the thaw clears the suspicion."""
    grantless = ClientConfig(transport="tcp", timeout_s=5.0, grant_bytes=0)
    flags = ("--node-ttl-ms", str(TTL_MS), "--heartbeat-ms", "200")
    with LocalCluster(3, dram="8MiB", master_args=flags) as c, Store.connect(c.master_address, grantless) as store:
        node = c.node_name(0)
        daemon = c.daemons[0]
        assert daemon is not None
        daemon.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20.0
            while not stats(c)["suspicions"]:
                assert time.monotonic() < deadline, "the frozen node was not suspected"
                time.sleep(0.05)
            for i in range(5):
                assert store.put(f"p{i}", b"v" * 4096, PutOptions(preferred_node=node)).value == "stored"
            reply = ask(c.master_address, GetReplicas([f"p{i}" for i in range(5)], [], False))
            assert isinstance(reply, GetReplicasReply)
            placed = {r.node_id for loc in reply.located([f"p{i}" for i in range(5)]) if loc for r in loc.replicas}
            assert node not in placed and placed
            assert up(store, node)  # suspected, not fenced: it may still serve (its TTL is a minute)
        finally:
            daemon.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 20.0
        while True:  # its heartbeat clears the suspicion: a put that prefers it goes to it again
            assert store.put("after", b"a" * 4096, PutOptions(preferred_node=node)).value == "stored"
            reply = ask(c.master_address, GetReplicas(["after"], [], False))
            assert isinstance(reply, GetReplicasReply)
            [loc] = reply.located(["after"])
            if loc is not None and loc.replicas[0].node_id == node:
                break
            assert store.remove("after")
            assert time.monotonic() < deadline, "the thawed node stayed suspected"
            time.sleep(0.1)

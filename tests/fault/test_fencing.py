"""A node silent past the node TTL is fenced: its daemon has stopped serving by then, so the master
counts the drops it never confirmed as done (a remove is answered, the key placeable again), and the
node serves again only once registered anew, its stale copies dropped; until then it refuses reads
(NotReady), never answering a miss for what it may hold. Checked with real processes:
a daemon killed and restarted, one frozen (SIGSTOP) and thawed, each read straight by key as a
hinted reader reads (no master in between)."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from bench.chaos_faults import GROUPS, Partitions
from bench.frames import ask
from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError, NotReady, RetryLater
from kvstore.protocol import GetReplicas, GetReplicasReply, GrantSpace, ListNodes, NodesReply
from kvstore_cli.cluster import LocalCluster
from kvstore_client.dataplane import DataPath
from kvstore_client.store import PutOptions, Store
from transfer.rpc import ConnectionPool
from transfer.wire import parse_address

TTL_MS = 800
TTL = ("--node-ttl-ms", str(TTL_MS), "--heartbeat-ms", "100")
TCP = ClientConfig(transport="tcp", timeout_s=5.0)
OLD, NEW = b"o" * 4096, b"n" * 4096


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="8MiB", master_args=TTL) as c:
        yield c


REFUSED = "refused"


def read_by_key(address: str, key: str) -> bytes | str | None:
    """The block under ``key`` as the daemon at ``address`` serves it to a reader that goes to it
    directly (a hinted read), None for a miss, REFUSED for NotReady (it may not serve now)."""
    pool = ConnectionPool(address, 2.0, 1)
    try:
        [found], [made] = DataPath("direct", address, pool).read_direct([key], [None])
    except NotReady:
        return REFUSED
    finally:
        pool.close()
    return None if found is None or made is None else bytes(made)


def read_located(cluster: LocalCluster, key: str) -> list[bytes]:
    """``key`` read from each replica where the master says it is (which vouches for a two-trip put's
    block: the daemon serves it by key from then on)."""
    reply = ask(cluster.master_address, GetReplicas([key], [], False))
    assert isinstance(reply, GetReplicasReply)
    [loc] = reply.located([key])
    assert loc is not None
    out = []
    for replica in loc.replicas:
        pool = ConnectionPool(replica.address, 2.0, 1)
        try:
            view = memoryview(bytearray(loc.size))
            assert DataPath(replica.node_id, replica.address, pool).read([(loc, replica, view)]) == [loc.size]
            out.append(bytes(view))
        finally:
            pool.close()
    return out


def both_replicas(cluster: LocalCluster, store: Store, key: str) -> None:
    assert store.put(key, OLD, PutOptions(replicas=2)).value == "stored"
    assert read_located(cluster, key) == [OLD, OLD]
    for i in range(2):
        assert read_by_key(cluster.daemon_addresses[i], key) == OLD


def remove_and_put_again(store: Store, key: str) -> float:
    """Remove ``key`` (one of its nodes silent) and put other bytes under it; returns the seconds the
    remove took. Before fencing, the remove waited for the silent node's drop and the key could not
    be placed until it came back."""
    began = time.monotonic()
    assert store.remove(key)
    took = time.monotonic() - began
    assert store.put(key, NEW).value == "stored"
    assert store.get(key) == NEW
    return took


def wait_registered(cluster: LocalCluster, i: int, key: str, timeout: float = 20.0) -> None:
    """Until daemon ``i`` serves again (it registered anew): a block put there now reads back."""
    deadline = time.monotonic() + timeout
    with Store.connect(cluster.master_address, TCP) as store:
        while True:
            probe = f"{key}-probe-{time.monotonic_ns()}"
            try:
                store.put(probe, b"p" * 4096, PutOptions(replicas=2))
                read_located(cluster, probe)
                if read_by_key(cluster.daemon_addresses[i], probe) == b"p" * 4096:
                    return
            except KVStoreError:
                pass
            assert time.monotonic() < deadline, f"daemon {i} did not serve again within {timeout} s"
            time.sleep(0.1)


def test_a_killed_node_is_fenced_and_its_restart_drops_what_was_removed(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address, TCP) as store:
        both_replicas(cluster, store, "k")
        cluster.kill_daemon(0)
        took = remove_and_put_again(store, "k")
        assert took < 5.0, took  # bounded by the TTL (plus ticks), not by the daemon's return
    cluster.start_daemon(0)  # on its arena, "k" (the old bytes) still in it
    # Not registered yet: it refuses (or waits for its registration, which drops the old "k")...
    assert read_by_key(cluster.daemon_addresses[0], "k") in (REFUSED, None)
    wait_registered(cluster, 0, "k")
    assert read_by_key(cluster.daemon_addresses[0], "k") is None  # its registration dropped the old "k"
    with Store.connect(cluster.master_address, TCP) as store:
        assert store.get("k") == NEW


def test_a_frozen_node_serves_nothing_when_thawed_until_it_registers_again(cluster: LocalCluster) -> None:
    daemon = cluster.daemons[0]
    assert daemon is not None
    with Store.connect(cluster.master_address, TCP) as store:
        both_replicas(cluster, store, "f")
        both_replicas(cluster, store, "g")
        daemon.send_signal(signal.SIGSTOP)
        try:
            remove_and_put_again(store, "f")  # waits for the fence
            assert store.remove("g")  # fenced already: its drop is settled without it
            time.sleep(TTL_MS / 1000)
        finally:
            daemon.send_signal(signal.SIGCONT)
        # Thawed past its lease: it serves nothing (the master counted its drops as done); it refuses,
        # or it registered anew meanwhile (its heartbeat refused, the registration dropped both)...
        assert read_by_key(cluster.daemon_addresses[0], "f") in (REFUSED, None)
        assert read_by_key(cluster.daemon_addresses[0], "g") in (REFUSED, None)
        wait_registered(cluster, 0, "f")
        # ... and once registered anew, the old "f" and "g" are gone: never the removed bytes.
        assert read_by_key(cluster.daemon_addresses[0], "f") is None
        assert read_by_key(cluster.daemon_addresses[0], "g") is None
        assert store.get("f") == NEW and store.get("g") is None and not store.exists("g")


def node_up(cluster: LocalCluster, i: int) -> bool:
    """Whether the master lists node ``i`` up (not fenced)."""
    reply = ask(cluster.master_address, ListNodes())
    assert isinstance(reply, NodesReply)
    return next(n.up for n in reply.nodes if n.node_id == cluster.node_name(i))


def test_a_remove_waits_for_a_frozen_node_only_its_lease_to_serve_by_key() -> None:
    """A node frozen (SIGSTOP) with a replica of "r": the remove waits for its drop only until its
    lease to serve by key lapses (three heartbeats), not until it is fenced (the node TTL, 1 s in
    bench.chaos: every worker stalled behind removes for that long). Thawed within its node lease,
    the daemon still holds the old "r" but serves it to no reader by key (its heartbeats renew
    nothing while it owes the drop); the key is put again at once, on the other node."""
    args = ("--node-ttl-ms", "8000", "--heartbeat-ms", "100")  # a fence would come long after the key lease (300 ms)
    with LocalCluster(2, dram="8MiB", master_args=args) as cluster, Store.connect(cluster.master_address, TCP) as store:
        both_replicas(cluster, store, "r")
        frozen = cluster.daemons[0]
        assert frozen is not None
        frozen.send_signal(signal.SIGSTOP)
        try:
            assert store.remove("r")
            assert node_up(cluster, 0)  # answered before the fence (the old code waited for it)
            assert store.get("r") is None and not store.exists("r")
            assert store.put("r", NEW).value == "stored"  # at once, on the node that owes no drop of it
            assert store.get("r") == NEW
        finally:
            frozen.send_signal(signal.SIGCONT)
        for _ in range(20):  # thawed: the old bytes are never served by key, whatever comes first
            assert read_by_key(cluster.daemon_addresses[0], "r") in (REFUSED, None)
        assert store.get("r") == NEW
        wait_registered(cluster, 0, "s")  # and it serves by key again once its drop is made
        assert read_by_key(cluster.daemon_addresses[0], "r") in (None, NEW)


def test_a_put_that_must_evict_on_a_frozen_node_goes_elsewhere_before_it_is_fenced() -> None:
    """Every node's DRAM is full, so a put's placement evicts on each node it asks, the frozen one
    included. The put waited for those evictions until the frozen node was fenced (its TTL: every
    put that asked it for room stalled that long in bench.chaos; here 8 s, past the client's 5 s);
    now the node is suspected once it missed two heartbeats, and the put plans again on the other
    two, evicting nothing on it and waiting for nothing it was sent."""
    args = ("--node-ttl-ms", "8000", "--heartbeat-ms", "100")
    with (
        LocalCluster(3, dram="1MiB", ssd="16MiB", master_args=args) as cluster,
        Store.connect(cluster.master_address, TCP) as store,
    ):
        for i in range(3 * 16):  # three DRAMs of 1 MiB, full: the blocks that follow evict
            assert store.put(f"fill-{i}", bytes([i]) * (64 << 10)).value == "stored"
        frozen = cluster.daemons[0]
        assert frozen is not None
        frozen.send_signal(signal.SIGSTOP)
        try:
            for i in range(6):
                assert store.put(f"new-{i}", b"n" * (64 << 10), PutOptions(replicas=2)).value == "stored"
                assert node_up(cluster, 0)  # answered before the fence
            reply = ask(cluster.master_address, GetReplicas([f"new-{i}" for i in range(6)], [], False))
            assert isinstance(reply, GetReplicasReply)
            assert cluster.node_name(0) not in set(reply.nodes) and len(reply.nodes) == 12  # two copies each, elsewhere
        finally:
            frozen.send_signal(signal.SIGCONT)
        assert store.get("new-0") == b"n" * (64 << 10)


def test_a_one_copy_block_on_a_node_the_master_suspects_is_a_miss_not_a_wait() -> None:
    """A block's one copy is on a frozen node that this client has never read from. The master,
    which suspects the node, says so with the replicas (GetReplicasReply.suspects); the client reads
    that copy with the failover patience only: a miss long before the fence. The old code waited for
    the daemon with no patience, here until the client's 30 s timeout, past the fence (3 of 53
    daemon SIGSTOPs in an hour of bench.chaos: reads of 3 s, until the node thawed)."""
    args = ("--node-ttl-ms", "8000", "--heartbeat-ms", "100")
    slow_client = ClientConfig(transport="tcp", timeout_s=30.0)
    with LocalCluster(2, dram="8MiB", master_args=args) as cluster:
        with Store.connect(cluster.master_address, TCP) as writer:
            assert writer.put("one", OLD, PutOptions(preferred_node=cluster.node_name(0))).value == "stored"
        frozen = cluster.daemons[0]
        assert frozen is not None
        frozen.send_signal(signal.SIGSTOP)
        try:
            for _ in range(100):  # the master suspects it once it missed three heartbeats
                reply = ask(cluster.master_address, GetReplicas(["one"], [], False))
                assert isinstance(reply, GetReplicasReply) and reply.nodes == [cluster.node_name(0)]
                if reply.suspects:
                    break
                time.sleep(0.05)
            assert reply.suspects == [cluster.node_name(0)]
            with Store.connect(cluster.master_address, slow_client) as reader:
                assert reader.get("one") is None
            assert node_up(cluster, 0)  # a miss before the fence, not a wait for the node
        finally:
            frozen.send_signal(signal.SIGCONT)
        with Store.connect(cluster.master_address, TCP) as reader:  # thawed: its heartbeat clears the suspicion
            for _ in range(50):
                if reader.get("one") == OLD:
                    break
                time.sleep(0.1)
            assert reader.get("one") == OLD


def test_a_one_copy_block_on_a_node_frozen_just_before_the_read_is_a_miss_before_the_node_thaws() -> None:
    """The same frozen node, but read at once: neither the master nor this client suspects it yet
    (it missed no heartbeat). The read asks the master again once its patience passed (the failover
    patience, then twice and four times that) and misses the block once the master suspects the
    node. The old code waited for the daemon with no patience: here until the node thaws, 10 s
    later, and then read the block (a 2.9 s read in bench.chaos's daemon SIGSTOP)."""
    args = ("--node-ttl-ms", "30000")
    slow_client = ClientConfig(transport="tcp", timeout_s=30.0)
    with LocalCluster(2, dram="8MiB", master_args=args) as cluster:
        with Store.connect(cluster.master_address, TCP) as writer:
            for key in ("one", "warm"):
                assert writer.put(key, OLD, PutOptions(preferred_node=cluster.node_name(0))).value == "stored"
        frozen = cluster.daemons[0]
        assert frozen is not None
        with Store.connect(cluster.master_address, slow_client) as reader:
            assert reader.get("warm") == OLD  # connected to the node ("one": not read yet, no hint)
            frozen.send_signal(signal.SIGSTOP)
            thaw = threading.Timer(10.0, frozen.send_signal, (signal.SIGCONT,))
            thaw.start()
            try:
                assert reader.get("one") is None  # a miss while the node is frozen, not OLD once it thawed
                assert thaw.is_alive()
            finally:
                thaw.cancel()
                frozen.send_signal(signal.SIGCONT)


def test_a_grant_on_a_frozen_node_is_given_up_within_a_second(cluster: LocalCluster) -> None:
    """The master opens a grant on its daemon before answering: a frozen daemon held the GrantSpace
    for the command timeout (10 s, past a client's 5 s: the put failed with Timeout); now it answers
    RetryLater after a second and the client puts the two-trip way meanwhile."""
    frozen = cluster.daemons[0]
    assert frozen is not None
    frozen.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(RetryLater):  # the old code answered Timeout, after the 10 s command timeout
            ask(cluster.master_address, GrantSpace(1 << 20, cluster.node_name(0)))
    finally:
        frozen.send_signal(signal.SIGCONT)


SYN_SENT = "02"  # /proc/net/tcp's state


def _dram_blocks(metrics: str) -> float:
    """The daemon's ``kvstore_daemon_dram_blocks`` (its metrics at host:port)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    [value] = re.findall(r"^kvstore_daemon_dram_blocks(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(value)


def _unacknowledged_to(port: int) -> list[int]:
    """Bytes sent and not yet acknowledged (tx_queue) of each loopback TCP socket whose peer is
    ``port``, connected or closing: a request TCP holds to send again once a cut heals (a socket
    still connecting holds its SYN alone)."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as table:
            for line in table.read().splitlines()[1:]:
                fields = line.split()
                remote, state, queues = fields[2], fields[3], fields[4]
                if state == SYN_SENT or int(remote.rsplit(":", 1)[1], 16) != port:
                    continue
                if queued := int(queues.split(":")[0], 16):
                    out.append(queued)
    return out


@pytest.mark.skipif(not Partitions.possible(), reason="needs root, iptables and its owner match")
def test_a_drop_to_a_node_cut_off_before_its_fence_is_given_up_with_the_fence() -> None:
    """A drop the master sent to a daemon cut off from it (iptables) waits in TCP, sent again with
    backoff. Once the node is fenced the master counts it as made, and the node's registration
    after the cut heals drops the block; the request itself must not reach the daemon later (a
    drop of whatever it holds under the key then: a block put since), nor hold the node's
    later commands behind it. The master resets its connections to a node it fences: checked where
    TCP holds the request (before 2f9a8c9 it stayed queued until the 10 s command timeout), and at
    the daemon, which must still hold the block seconds later (2f9a8c9 closed the socket without
    a reset: the kernel went on sending the request from a socket nobody owned, which the
    partition's owner match no longer stopped, and the daemon dropped the block)."""
    with LocalCluster(2, dram="8MiB", master_args=TTL, groups=GROUPS, daemon_metrics=True) as cluster:
        cuts = Partitions()
        try:
            with Store.connect(cluster.master_address, TCP) as store:
                both_replicas(cluster, store, "warm")
                assert store.remove("warm")  # the master's connection for drops to the daemon is made
                both_replicas(cluster, store, "k")
                held_blocks = _dram_blocks(cluster.daemon_metrics[0])
                port = parse_address(cluster.daemon_addresses[0])[1]
                master = [cluster.gid("master", 0)]
                cuts.cut([cluster.gid("daemon", 0)], [cluster.master_port], master, [port])
                cut_at = time.monotonic()
                assert store.remove("k")  # answered once the cut-off node's lease to serve by key lapsed
                deadline = time.monotonic() + 10.0
                while True:
                    reply = ask(cluster.master_address, ListNodes())
                    assert isinstance(reply, NodesReply)
                    if not next(n for n in reply.nodes if n.node_id == cluster.node_name(0)).up:
                        break
                    assert time.monotonic() < deadline, "the cut-off node was not fenced within 10 s"
                    time.sleep(0.05)
                deadline = time.monotonic() + 2.0  # the master's next tick gives its links up
                while (held := _unacknowledged_to(port)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert held == []
                # TCP sends again 0.2, 0.6, 1.4 and 3.0 s after the first send: past those, the drop
                # never reached the daemon.
                time.sleep(max(0.0, cut_at + 4.0 - time.monotonic()))
                assert _dram_blocks(cluster.daemon_metrics[0]) == held_blocks
                cuts.heal()
                wait_registered(cluster, 0, "k")
                assert store.put("k", NEW, PutOptions(replicas=2)).value == "stored"
                assert read_located(cluster, "k") == [NEW, NEW]
        finally:
            cuts.remove()

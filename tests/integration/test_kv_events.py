"""KV events out of real masters (``--kv-events``), read by a real ZMQ subscriber: a follower that
applies them holds what the master stores, through puts with replicas, demotions to SSD,
removes, evictions and a daemon killed; a late subscriber replays what it missed; and across a
leader change (HA masters on etcd) sequences grow, the new leader clears and tells again, and
the follower ends holding the store's keys."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from urllib.parse import quote

import pytest
import zmq

from kvstore.errors import InvalidArgument
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlock, key_hash
from kvstore_cli.cluster import LocalCluster, LocalEtcd
from kvstore_client import PutOptions, Store
from kvstore_client.events import KVEventSubscriber, starts_term

KB = 1024
Held = set[tuple[str, str, str]]


class Follower:
    """A router's view from the events: (key, node, medium) it believes stored."""

    def __init__(self, sub: KVEventSubscriber) -> None:
        self.sub = sub
        self.held: Held = set()
        self.seqs: list[int] = []
        self.terms = 0
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def pump(self, seconds: float = 0.2) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for d in self.sub.receive(left):
                self.seqs.append(d.seq)
                self.terms += starts_term(d.batch)
                for e in d.batch.events:
                    self.events.append(e)
                    if isinstance(e, AllBlocksCleared):  # a new term's (all), or a node's fence (its own)
                        self.held -= {h for h in self.held if e.backend_id in (None, h[1])}
                        continue
                    assert e.object_key is not None and e.backend_id is not None and e.medium is not None
                    item = (e.object_key, e.backend_id, e.medium)
                    if isinstance(e, BlockStored):
                        self.held.add(item)
                    else:
                        self.held.discard(item)

    def until(self, what: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, f"events did not come: held {sorted(self.held)[:10]}"
            self.pump(0.1)

    def agree(self, admin: str, keys: list[str], timeout: float = 15.0) -> None:
        """Wait until the follower holds what the master stores of ``keys``; else say the difference."""
        deadline = time.monotonic() + timeout
        while (truth := stored(admin, keys)) != self.held:
            assert time.monotonic() < deadline, (
                f"told but not stored: {sorted(self.held - truth)}; stored but not told: {sorted(truth - self.held)}"
            )
            self.pump(0.1)


def stored(admin: str, keys: list[str]) -> Held:
    """What the master says it stores of ``keys`` (its admin API), as (key, node, medium)."""
    out: Held = set()
    for key in keys:
        try:
            with urllib.request.urlopen(f"http://{admin}/api/v1/keys/{quote(key, safe='')}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:
            assert e.code == 404
            continue
        for r in body["replicas"]:
            if r["status"] == "ready" and r["node_up"] and body["state"] == "committed":
                out.add((key, r["node_id"], "cpu" if r["tier"] == "dram" else "disk"))
    return out


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="1MiB", ssd="8MiB", admin=True, kv_events=True) as c:
        yield c


def test_a_follower_holds_what_the_master_stores(cluster: LocalCluster) -> None:
    pub, replay = cluster.kv_events[0]
    with KVEventSubscriber([pub], [replay], from_seq=0) as sub, Store.connect(cluster.master_address) as store:
        f = Follower(sub)
        keys = [f"ev/{i}" for i in range(40)]
        for key in keys[:8]:
            store.put(key, key.encode() * 100, PutOptions(replicas=2))
        f.until(lambda: {(k, n) for k, n, _ in f.held} >= {(k, f"node{i}") for k in keys[:8] for i in (0, 1)})
        assert f.terms == 1 and isinstance(f.events[0], AllBlocksCleared)  # replayed from the term's start
        first = next(e for e in f.events if isinstance(e, BlockStored) and e.object_key == "ev/0")
        assert first.block_hashes == [key_hash("ev/0")] and first.medium == "cpu"

        for key in keys[8:]:  # 32 x 64 KiB into 2 x 1 MiB of DRAM: demotions to SSD
            store.put(key, bytes(64 * KB))
        store.remove("ev/1")
        store.put("ev/1", b"again")
        f.agree(cluster.admin_address, keys)
        assert any(m == "disk" for _, _, m in f.held), "no demotion was told"
        assert sum(isinstance(e, BlockRemoved) and e.object_key == "ev/1" for e in f.events) >= 2  # both replicas

        cluster.kill_daemon(1)  # its replicas go when the master fences it
        f.until(lambda: not any(n == "node1" for _, n, _ in f.held))
        f.agree(cluster.admin_address, keys)
        assert f.sub.lost == 0 and f.sub.bad == 0
        assert f.seqs == sorted(set(f.seqs)) and f.seqs == list(range(f.seqs[0], f.seqs[0] + len(f.seqs)))


def test_labelled_puts_are_told_by_the_engines_hashes(cluster: LocalCluster) -> None:
    pub, replay = cluster.kv_events[0]
    labels = [EngineBlock(bytes([i]) * 32, bytes([i - 1]) * 32 if i else None, [i] * 16, 16) for i in range(3)]
    with KVEventSubscriber([pub], [replay]) as sub, Store.connect(cluster.master_address) as store:
        keys = [f"eng/{i}" for i in range(3)]
        store.label_blocks(keys, labels)
        for key in keys:
            store.put(key, b"kv" * 100)
        f = Follower(sub)
        f.until(lambda: {k for k, _, _ in f.held} >= set(keys))
        told = {e.object_key: e for e in f.events if isinstance(e, BlockStored)}
        for key, label in zip(keys, labels, strict=True):
            e = told[key]
            assert (e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size) == (
                [label.block_hash],
                label.parent_block_hash,
                label.token_ids,
                16,
            )
        store.remove("eng/1")
        f.until(lambda: any(isinstance(e, BlockRemoved) and e.object_key == "eng/1" for e in f.events))
        gone = next(e for e in f.events if isinstance(e, BlockRemoved) and e.object_key == "eng/1")
        assert gone.block_hashes == [bytes([1]) * 32]
        with pytest.raises(InvalidArgument, match="block_hash is 65 bytes"):
            store.label_blocks(["eng/x"], [EngineBlock(b"h" * 65)])
        with pytest.raises(InvalidArgument, match="2 keys but 1 labels"):
            store.label_blocks(["a", "b"], [EngineBlock(1)])


def test_a_subscriber_that_missed_batches_replays_them(cluster: LocalCluster) -> None:
    pub, replay = cluster.kv_events[0]
    with Store.connect(cluster.master_address) as store:
        for i in range(5):
            store.put(f"early/{i}", b"x" * 100)
        time.sleep(0.3)  # published before anyone listened
        with KVEventSubscriber([pub], [replay], from_seq=0) as late:
            store.put("late/0", b"y")
            f = Follower(late)
            f.until(lambda: ("late/0", "node0", "cpu") in f.held or ("late/0", "node1", "cpu") in f.held)
            assert {k for k, _, _ in f.held} == {*(f"early/{i}" for i in range(5)), "late/0"}
            assert late.lost == 0


def test_a_replay_request_in_vllms_protocol(cluster: LocalCluster) -> None:
    """The replay socket speaks vLLM's protocol, byte for byte: [b"", start] in, then
    [b"", topic, seq, batch] per batch and [b"", b"", END_SEQ, b""] at the end."""
    replay = cluster.kv_events[0][1]
    with Store.connect(cluster.master_address) as store:
        store.put("r/0", b"z")
    time.sleep(0.3)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(replay)
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        replies = []
        while sock.poll(5000):
            frames = sock.recv_multipart()
            replies.append(frames)
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
        assert len(replies) >= 2 and replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert all(len(r) == 4 and r[0] == b"" and r[1] == b"" for r in replies)
        seqs = [int.from_bytes(r[2], "big") for r in replies[:-1]]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian: apt install etcd-server)")
@pytest.mark.timeout(120)
def test_a_leader_change_is_a_gap_then_a_new_term_that_tells_everything_again(etcd: LocalEtcd) -> None:
    with LocalCluster(2, dram="16MiB", etcd=etcd.endpoint, cluster_id="events-ha", masters=2, admin=True,
                      kv_events=True) as c:  # fmt: skip
        pubs = [p for p, _ in c.kv_events]
        replays = [r for _, r in c.kv_events]
        with KVEventSubscriber(pubs, replays, from_seq=0) as sub, Store.connect(c.master_address) as store:
            f = Follower(sub)
            for i in range(10):
                store.put(f"ha/{i}", b"v" * 500, PutOptions(replicas=2))
            keys = {f"ha/{i}" for i in range(10)}
            f.until(lambda: {k for k, _, _ in f.held} == keys)
            before = list(f.seqs)
            leader = c.leader_index()
            c.kill_ha_master(leader)
            store.put("ha/after", b"w")  # waits for the new leader
            f.until(lambda: f.terms == 2 and {k for k, _, _ in f.held} == keys | {"ha/after"}, timeout=30)
            admin = c.master_admin[1 - leader]
            f.agree(admin, [*keys, "ha/after"])
            assert f.seqs == sorted(set(f.seqs)), "a repeat or a reorder"
            assert f.seqs[len(before)] > before[-1] + 1  # the new term's first: a gap, never a repeat
            assert sub.lost == 0

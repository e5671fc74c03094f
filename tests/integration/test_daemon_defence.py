"""A daemon holds up against peers that misbehave, whatever they are allowed to send: stalled
huge frames cost it no memory, connections are bounded per peer and in total, and no write lands
on another block's bytes. Real processes on loopback; each attack's outcome goes to the output."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config import DramConfig, SsdConfig
from kvstore.keys import BlockKey, checksum
from kvstore.protocol import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    CommandReply,
    DropBlocks,
    FetchBlocks,
    WriteBlocks,
    WriteReply,
)
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from server.daemon.service import DaemonServer
from server.daemon.storage import DaemonStorage
from transfer.wire import connect, recv_message, send_message

KB, MB = 1024, 1024 * 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    args = ("--max-connections", "96", "--max-connections-per-peer", "80")
    with LocalCluster(1, dram="16MiB", daemon_args=args) as c:
        yield c


def _address(cluster: LocalCluster) -> tuple[str, int]:
    host, port = cluster.daemon_addresses[0].rsplit(":", 1)
    return host, int(port)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * KB for line in f if line.startswith("VmRSS:"))


def test_stalled_maximal_frames_cost_the_daemon_and_the_master_no_memory(cluster: LocalCluster) -> None:
    daemon, master = cluster.daemons[0], cluster.master
    assert daemon is not None and master is not None
    host, port = cluster.master_address.rsplit(":", 1)
    with Store.connect(cluster.master_address) as store:
        store.put("before", b"b" * 10_000)
        before = _rss(daemon.pid), _rss(master.pid)
        attackers = []
        for target in [_address(cluster), (host, int(port))]:
            for _ in range(64):
                s = socket.create_connection(target, timeout=5, source_address=("127.0.0.3", 0))
                s.sendall(FRAME_HEADER.pack(MAX_FRAME_BYTES) + b"\x00" * 100)  # a maximal frame, then a stall
                attackers.append(s)
        time.sleep(1.0)
        grown = _rss(daemon.pid) - before[0], _rss(master.pid) - before[1]
        try:
            # Others are still served while the 64 stall.
            store.put("during", b"d" * 10_000)
            assert store.get("before") == b"b" * 10_000 and store.get("during") == b"d" * 10_000
        finally:
            for s in attackers:
                s.close()
    print(json.dumps({
        "test": "stalled_frames", "connections": 64,
        "daemon_rss_growth_mb": round(grown[0] / MB, 1), "master_rss_growth_mb": round(grown[1] / MB, 1),
    }))  # fmt: skip
    assert grown[0] < 64 * MB and grown[1] < 64 * MB


def test_connections_beyond_the_limits_are_closed_and_others_served(cluster: LocalCluster) -> None:
    # The flood comes from 127.0.0.2 (another peer on loopback); the store's connections from 127.0.0.1.
    def flood() -> socket.socket:
        return socket.create_connection(_address(cluster), timeout=5, source_address=("127.0.0.2", 0))

    held = [flood() for _ in range(80)]
    try:
        extra = flood()
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at accept: over the per-peer limit
        extra.close()
        with Store.connect(cluster.master_address) as store:
            store.put("limits", b"x" * 5000)
            assert store.get("limits") == b"x" * 5000
    finally:
        for s in held:
            s.close()
    # Once those are gone, the same peer is served again.
    deadline = time.monotonic() + 10
    while True:
        s = flood()
        s.settimeout(0.3)
        try:
            if s.recv(1) == b"":
                s.close()
                assert time.monotonic() < deadline, "the daemon never freed its per-peer count"
                time.sleep(0.1)
                continue
        except TimeoutError:
            break  # held open: served
        finally:
            s.close()


def test_a_write_at_another_blocks_extent_is_refused_and_the_block_keeps_its_bytes(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address) as store:
        victim = b"v" * 8192
        store.put("victim", victim)
        with store._located(["victim"]) as [loc]:  # where the master placed it
            assert loc is not None
            offset = loc.replicas[0].offset
        evil = b"e" * 8192
        sock = connect(cluster.daemon_addresses[0], 5.0)
        with sock:
            send_message(sock, WriteBlocks(["planted"], [offset], [len(evil)], [checksum(evil)], False), 1, [evil])
            _, reply = recv_message(sock)
        assert isinstance(reply, WriteReply) and reply.codes[0] != 0, "the planted write was stored"
        assert "overlaps" in reply.errors[0]
        assert store.get("victim") == victim
        assert store.get("victim", verify=True) == victim
    print(json.dumps({"test": "overlapping_write", "refused": reply.errors[0]}))


def test_a_dropped_block_cuts_its_stalled_writer_before_its_extent_is_reused(tmp_path: Path) -> None:
    # A writer stalls halfway through a block; the master gives the put up and drops it, then
    # places another block at the same extent. The rest of the stalled bytes must never land there.
    storage = DaemonStorage(
        DramConfig(capacity=1 * MB, name="cut", shm_dir=tmp_path, prefault=False), SsdConfig(capacity=0)
    )
    server = DaemonServer(storage)
    server.start()
    try:
        stalled = connect(server.address, 5.0)
        first = b"s" * 8192
        send_message(stalled, WriteBlocks(["stalled"], [0], [len(first)], [checksum(first)], False), 1, [first[:100]])
        time.sleep(0.2)  # the daemon is receiving into the extent now
        with connect(server.address, 5.0) as master:
            start = time.monotonic()
            send_message(master, DropBlocks(["stalled"]), 2)
            _, done = recv_message(master)
            assert isinstance(done, CommandReply)  # gone either way (the cut writer aborted it first)
            victim = b"v" * 8192
            send_message(master, WriteBlocks(["victim"], [0], [len(victim)], [checksum(victim)], False), 3, [victim])
            _, stored = recv_message(master)
            assert isinstance(stored, WriteReply) and stored.codes == [0]
        with contextlib.suppress(OSError):  # the rest of the stalled block: cut off, never written
            stalled.sendall(first[100:])
        stalled.close()
        time.sleep(0.2)
        with storage.read_views([BlockKey("victim")]) as [view]:
            assert view is not None and bytes(view) == victim
        print(json.dumps({"test": "stalled_writer_cut", "drop_s": round(time.monotonic() - start, 3)}))
    finally:
        server.stop()
        storage.close()


def test_a_copy_whose_drop_came_first_is_never_committed(tmp_path: Path) -> None:
    # The master gave a copy up (its FetchBlocks went unanswered) and dropped it before the target
    # began it; the late fetch must not commit the block into an extent the master reuses.
    def daemon(name: str) -> tuple[DaemonStorage, DaemonServer]:
        storage = DaemonStorage(
            DramConfig(capacity=1 * MB, name=name, shm_dir=tmp_path, prefault=False), SsdConfig(capacity=0)
        )
        server = DaemonServer(storage)
        server.start()
        return storage, server

    (source_storage, source), (target_storage, target) = daemon("fence-src"), daemon("fence-dst")
    try:
        block = b"c" * 4096
        fetch = FetchBlocks(source.address, ["k"], [0], [len(block)], [checksum(block)])
        with connect(source.address, 5.0) as master:
            send_message(master, WriteBlocks(["k"], [0], [len(block)], [checksum(block)], False), 1, [block])
            _, stored = recv_message(master)
            assert isinstance(stored, WriteReply) and stored.codes == [0]
        with connect(target.address, 5.0) as master:
            send_message(master, DropBlocks(["k"], "", [0]), 2)  # nothing there yet
            _, dropped = recv_message(master)
            assert isinstance(dropped, CommandReply) and dropped.done == [False]
            send_message(master, fetch, 3)  # the copy, late
            _, copied = recv_message(master)
            assert isinstance(copied, CommandReply) and copied.done == [False]
            assert target_storage.inventory() == []
            send_message(master, fetch, 4)  # a copy asked for again, later: the fence is spent
            _, again = recv_message(master)
            assert isinstance(again, CommandReply) and again.done == [True]
    finally:
        for server, storage in ((source, source_storage), (target, target_storage)):
            server.stop()
            storage.close()

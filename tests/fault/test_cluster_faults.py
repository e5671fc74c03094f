"""Kill clients, daemons and the master; send garbage. Committed blocks survive, nothing hangs."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvstore.config import ClientConfig
from kvstore.errors import ProtocolError
from kvstore.protocol import FRAME_HEADER, PutStart, PutStartReply, Stats, StatsReply, encode
from kvstore.results import PutStatus
from kvstore_cli.cluster import LocalCluster
from kvstore_client.puts import PutOptions
from kvstore_client.store import Store
from transfer.rpc import Connection
from transfer.wire import recv_message

REPO = Path(__file__).resolve().parents[2]
FAST = ("--reservation-ms", "800", "--node-ttl-ms", "1500", "--heartbeat-ms", "100", "--lease-ms", "500")
KB = 1024


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="8MiB", ssd="16MiB", master_args=FAST) as c:
        yield c


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="8MiB", master_args=FAST) as c:
        yield c


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 32 * KB), dtype=np.uint8)


def test_client_killed_mid_put_leaves_the_key_writable_after_the_reservation(cluster: LocalCluster) -> None:
    script = (
        "import os, signal; from transfer.rpc import Connection;"
        "from kvstore.protocol import PutStart, PutStartReply;"
        f"r = Connection('{cluster.master_address}').call(PutStart(['orphan'], [4096], 1, None, False), PutStartReply);"
        "assert r.statuses[0] == 'ok'; print('reserved', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    child = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert child.returncode == -signal.SIGKILL and "reserved" in child.stdout
    with Store.connect(cluster.master_address) as store:
        assert not store.exists("orphan")
        deadline = time.monotonic() + 10
        while True:  # until the reservation expires the key reads as being written
            if store.put("orphan", b"z" * 4096) is PutStatus.STORED:
                break
            assert time.monotonic() < deadline, "the reservation never expired"
            time.sleep(0.1)
        assert store.get("orphan") == b"z" * 4096
        assert store.stats()["expired"] >= 1


def test_killed_daemon_reads_as_misses_then_comes_back_byte_exact(cluster: LocalCluster) -> None:
    data = blocks(64, seed=2)
    keys = [f"d-{i}" for i in range(len(data))]
    # Over the network: a same-host client would go on copying the dead daemon's blocks from its arena.
    with Store.connect(cluster.master_address, ClientConfig(transport="tcp")) as store:
        for s in range(0, len(keys), 8):  # a batch stays on one node: several batches spread over both
            store.put_many(zip(keys[s : s + 8], data[s : s + 8], strict=True))
        cluster.kill_daemon(0)
        t = time.monotonic()
        out = np.zeros_like(data)
        got = store.get_many_into(keys, list(out))
        assert time.monotonic() - t < 5, "reads of a dead node's blocks must not hang"
        lost = [i for i, n in enumerate(got) if n is None]
        assert 0 < len(lost) < len(keys)  # node0's share is missing, node1's is served
        assert all(np.array_equal(out[i], data[i]) for i, n in enumerate(got) if n is not None)
        cluster.restart_daemon(0)
        out[:] = 0
        assert store.get_many_into(keys, list(out), verify=True) == [32 * KB] * len(keys)
        assert np.array_equal(out, data)


def test_a_copy_stuck_on_a_frozen_source_does_not_hold_up_puts_to_its_target(cluster: LocalCluster) -> None:
    """The master's commands to one daemon go on separate connections by kind: a copy waiting on a frozen
    source (up to the command timeout) must not queue the grant a put to the same target waits for."""
    source, target = cluster.node_name(0), cluster.node_name(1)
    data = blocks(4, seed=5)
    keys = [f"frozen-{i}" for i in range(len(data))]
    with Store.connect(cluster.master_address, ClientConfig(transport="tcp")) as store:
        statuses = store.put_many(zip(keys, data, strict=True), PutOptions(preferred_node=source))
        assert statuses == [PutStatus.STORED] * len(keys)
    daemon = cluster.daemons[0]
    assert daemon is not None
    copied: list[object] = []
    daemon.send_signal(signal.SIGSTOP)
    try:

        def replicate() -> None:
            with Store.connect(cluster.master_address) as copier:
                try:
                    copied.append(copier.replicate(keys, target, max_bytes=1 << 20))
                except Exception as exc:  # the copy fails when the master gives up on it: either is fine
                    copied.append(exc)

        copying = threading.Thread(target=replicate, daemon=True)
        copying.start()
        time.sleep(1.0)  # the copy is with the target's daemon now, which waits on the frozen source
        assert copying.is_alive()  # (the blocks are on the frozen source: nothing else holds the copy up)
        with Store.connect(cluster.master_address, ClientConfig(transport="tcp")) as writer:
            assert writer.put("during-copy", b"w" * 4096, PutOptions(preferred_node=target)) is PutStatus.STORED
            assert writer.get("during-copy") == b"w" * 4096
        assert copying.is_alive(), "the put waited for the copy: both went down one connection"
    finally:
        daemon.send_signal(signal.SIGCONT)
    copying.join(timeout=60)
    assert not copying.is_alive() and copied


def test_master_restarted_from_nothing_rebuilds_from_the_daemons(cluster: LocalCluster) -> None:
    data = blocks(300, seed=3)  # ~9.4 MiB: some of it demoted to SSD
    keys = [f"m-{i}" for i in range(len(data))]
    with Store.connect(cluster.master_address) as store:
        for s in range(0, len(keys), 50):
            store.put_many(zip(keys[s : s + 50], data[s : s + 50], strict=True))
        before = [k for k, ok in zip(keys, store.exists_many(keys), strict=True) if ok]
        assert len(before) == len(keys)
    with Store.connect(cluster.master_address) as store:
        cluster.kill_master()
        # The client rides out the outage: its call waits, with backoff, for the new master.
        restarter = threading.Timer(0.5, cluster.restart_master)
        restarter.start()
        out = np.zeros_like(data)
        try:
            got = store.get_many_into(keys, list(out), verify=True)
        finally:
            restarter.join()
        # The first call may land before every daemon re-registered: what it saw is exact, and soon all is back.
        assert all(np.array_equal(out[i], data[i]) for i, n in enumerate(got) if n is not None)
        out[:] = 0
        assert store.get_many_into(keys, list(out), verify=True) == [32 * KB] * len(keys)
        assert np.array_equal(out, data)
        assert store.stats()["objects"] >= len(keys)


def raw_exchange(address: str, frame: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(frame)
        with contextlib.suppress(OSError):  # the server may have closed already: that is an answer too
            s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass  # closed with our garbage unread (reset, or not connected): a close is an accepted answer
        return b"".join(chunks)


def payload(*items: object) -> bytes:
    body = msgpack.packb(list(items), use_bin_type=True)
    return FRAME_HEADER.pack(len(body)) + body


@pytest.mark.parametrize("target", ["master", "daemon"])
@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(payload(1, 38, 7, [])[:-1], id="truncated"),
        pytest.param(payload(99, 38, 7, []), id="wrong-version"),
        pytest.param(payload(1, 9999, 7, []), id="unknown-kind"),
        pytest.param(payload(1, 20, 7, ["not", "a", "put"]), id="malformed-fields"),
        pytest.param(FRAME_HEADER.pack(1 << 30) + b"x" * 100, id="oversize"),
        pytest.param(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", id="not-msgpack"),
    ],
)
def test_bad_frames_get_an_error_or_a_close_and_service_continues(
    shared_cluster: LocalCluster, target: str, frame: bytes
) -> None:
    """One cluster takes every bad frame in turn, and serves after each."""
    cluster = shared_cluster
    address = cluster.master_address if target == "master" else cluster.daemon_addresses[1]
    answer = raw_exchange(address, frame)  # returns once the server closes or answers and we hang up
    if answer:
        (length,) = FRAME_HEADER.unpack_from(answer)
        reply = msgpack.unpackb(answer[4 : 4 + length])
        assert reply[2][0] == 1, reply  # [version, request id, [ErrorReply's kind, code, text]]
        assert reply[2][1] == ProtocolError.code
    with Store.connect(cluster.master_address) as store:
        store.put(f"after-{target}-{len(frame)}-{frame[-1]}", b"still serving")
        assert store.stats()["nodes_up"] == 2
    assert Connection(cluster.master_address).call(Stats(), StatsReply).stats["nodes_up"] == 2


def test_a_reply_always_names_its_request(shared_cluster: LocalCluster) -> None:
    host, port = shared_cluster.master_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(encode(PutStart(["rid"], [10], 1, None, False), 4242) + encode(Stats(), 4243))
        # Replies may overtake each other (a quick request is answered while a put waits for room):
        # each names its request.
        replies = dict([recv_message(s), recv_message(s)])
        assert isinstance(replies[4242], PutStartReply) and isinstance(replies[4243], StatsReply)


def test_two_clients_whose_request_ids_collide_each_get_their_own_answer(shared_cluster: LocalCluster) -> None:
    """Seen with two vLLM servers (each seeds `random` alike): their connectors' puts drew the same ids, and the
    master answered one client's PutStart with the other's kept answer ("9 tickets for 10 keys")."""
    host, port = shared_cluster.master_address.rsplit(":", 1)
    replies = []
    for keys in (["collide-a"], ["collide-b", "collide-c"]):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(encode(PutStart(keys, [4096] * len(keys), 1, None, False), 555000111))
            replies.append(recv_message(s)[1])
    assert isinstance(replies[0], PutStartReply) and replies[0].statuses == ["ok"]
    assert isinstance(replies[1], PutStartReply) and replies[1].statuses == ["ok", "ok"]
    # Connections draw their ids from the OS, whatever the application did to `random`.
    random.seed(0)
    first = next(Connection(shared_cluster.master_address)._ids)
    random.seed(0)
    assert next(Connection(shared_cluster.master_address)._ids) != first


def test_a_retried_put_start_gets_the_first_answer(shared_cluster: LocalCluster) -> None:
    """A client whose connection broke after sending resends the same request id on a new one."""
    frame = encode(PutStart(["retried"], [4096], 1, None, False), 987654321)
    host, port = shared_cluster.master_address.rsplit(":", 1)
    answers = []
    for _ in range(2):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(frame)
            answers.append(recv_message(s))
    assert answers[0] == answers[1]
    reply = answers[0][1]
    assert isinstance(reply, PutStartReply) and reply.statuses == ["ok"]
    fresh = Connection(shared_cluster.master_address).call(PutStart(["retried"], [4096], 1, None, False), PutStartReply)
    assert fresh.statuses == ["exists"]  # a new request (new id) does see the reservation

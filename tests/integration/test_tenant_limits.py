"""One tenant cannot take the cluster (issue 38): each attack tried as an attacker holding one
tenant's token would, with raw frames where it speaks them, on a real cluster that authenticates
(a master and two daemons, processes on loopback)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from bench.frames import REQUEST_IDS, ask, raw, ticket
from kvstore.auth import tenant_credential
from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied, QuotaExceeded
from kvstore.protocol import (
    FRAME_HEADER,
    MAX_BATCH_KEYS,
    ErrorReply,
    Exists,
    GetReplicas,
    GetReplicasReply,
    GrantSpace,
    OkReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    Remove,
    Stats,
    StatsReply,
    WriteSlices,
)
from kvstore.results import PutStatus
from kvstore.tenants import set_tenant
from kvstore_cli.cluster import LocalCluster
from kvstore_client import PutOptions, Store
from transfer.wire import NoRequest, recv_message, send_message

FRAME_TIMEOUT_S, TENANT_IDLE_S = 1.0, 2.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    env = {
        "KVSTORE_MASTER_FRAME_TIMEOUT_S": str(FRAME_TIMEOUT_S),
        "KVSTORE_MASTER_TENANT_IDLE_TIMEOUT_S": str(TENANT_IDLE_S),
    }
    with LocalCluster(2, dram="32MiB", authenticate=True, env=env) as c:
        yield c


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed ``sock`` (reading whatever it sent first); None if it did not."""
    began = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - began < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - began
        except TimeoutError:
            continue
        except OSError:  # reset
            return time.monotonic() - began
    return None


def test_a_huge_batch_is_refused_before_any_work_and_a_client_splits_its_own(cluster: LocalCluster) -> None:
    """A 200,000-key PutStart used to hold every other client of the master 2.3 s (and a 500,000-key
    GetReplicas 1 s): a request names at most MAX_BATCH_KEYS keys, and the client splits larger ones."""
    token = cluster.add_tenant("batcher")
    credential, master = tenant_credential(token), cluster.master_address
    many = [f"k{i}" for i in range(200_000)]
    with pytest.raises(
        InvalidArgument, match=rf"PutStart\.keys names 200000 items; a request takes at most {MAX_BATCH_KEYS}"
    ):
        ask(master, PutStart(many, [1] * len(many), 1, None, False), credential)
    with pytest.raises(InvalidArgument, match=r"GetReplicas\.keys names 500000 items"):
        ask(master, GetReplicas([f"k{i}" for i in range(500_000)], [], False), credential)
    with pytest.raises(InvalidArgument, match=r"GetReplicas\.release names"):
        ask(master, GetReplicas(["k"], list(range(MAX_BATCH_KEYS + 1)), False), credential)
    for message in (Exists(many[: MAX_BATCH_KEYS + 1]), Remove(many[: MAX_BATCH_KEYS + 1])):
        with pytest.raises(InvalidArgument, match=f"a request takes at most {MAX_BATCH_KEYS}"):
            ask(master, message, credential)
    n = 2 * MAX_BATCH_KEYS + 7
    keys = [f"b{i}" for i in range(n)]
    values = [i.to_bytes(4, "big") for i in range(n)]
    with Store.connect(master, ClientConfig(token=token, transport="tcp")) as store:
        assert store.put_many(zip(keys, values, strict=True)) == [PutStatus.STORED] * n
        assert store.get_many(keys) == values
        assert store.exists_many([*keys, "absent"]) == [True] * n + [False]
        assert store.sizes(keys[-3:]) == [4, 4, 4]
        assert store.match_prefix(keys) == n
        assert store.match_prefix([*keys[: MAX_BATCH_KEYS + 2], "absent", *keys[-5:]]) == MAX_BATCH_KEYS + 2
        match = store.match_prefix_nodes(keys)
        assert match.longest == n and match.nodes  # each node's leading run, carried across the batches
        holders = {node for node, run in match.nodes.items() if run.total > MAX_BATCH_KEYS}
        assert all(run.total <= n and run.dram <= run.total for run in match.nodes.values())
        assert len(holders) <= 1
        assert store.remove_many(keys) == n
        assert store.exists_many(keys) == [False] * n


@pytest.mark.slow
def test_a_stalled_frame_is_dropped_with_its_connection_and_idle_tenant_sessions_end(cluster: LocalCluster) -> None:
    """Six authenticated connections each sending 48 MiB of a 64 MiB frame and stopping used to hold
    288 MiB of the master until its 600 s idle limit: a frame begun must arrive within
    frame_timeout_s. An idle tenant's session ends after tenant_idle_timeout_s (its client
    connects again), long before 600 s."""
    token = cluster.add_tenant("staller")
    sock, _ = raw(cluster.master_address, tenant_credential(token))
    with sock:
        sock.sendall(FRAME_HEADER.pack(8 << 20) + bytes(4 << 20))  # half a frame, then nothing
        waited = closed_within(sock, FRAME_TIMEOUT_S + 10)
    assert waited is not None, "the master kept a connection stalled mid-frame"
    assert waited < TENANT_IDLE_S + 1  # the frame's deadline closed it, not the idle one
    idle, _ = raw(cluster.master_address, tenant_credential(token))
    with idle:
        assert closed_within(idle, TENANT_IDLE_S + 10) is not None, "an idle tenant session was kept"
    with Store.connect(cluster.master_address, ClientConfig(token=token, transport="tcp")) as store:
        store.put("before", b"x")
        time.sleep(TENANT_IDLE_S + 1)  # its connections are closed meanwhile
        assert store.get("before") == b"x"
        assert store.put("after", b"y") is PutStatus.STORED


def test_writes_after_a_revoke_are_refused_and_never_block_another_tenant(cluster: LocalCluster) -> None:
    """PutStart of 7 x 1 MiB to one node, PutRevoke, then WriteSlices of 64 KiB into each with the
    seals never used: all were taken, the half-written blocks counted as "being written" for the
    daemon's 120 s staleness (restarted by every refused write), and bob's puts to that node failed
    for 77 s. The revoke's drop now voids the seals before the master answers it."""
    alice, bob = cluster.add_tenant("reviver"), cluster.add_tenant("neighbour")
    credential, master = tenant_credential(alice), cluster.master_address
    keys, size = [f"half-{i}" for i in range(7)], 1 << 20
    reserved = ask(master, PutStart(keys, [size] * 7, 1, "node0", False), credential)
    assert isinstance(reserved, PutStartReply)
    replicas = [t.replicas[0] for t in reserved.tickets()]
    [node] = {r.node_id for r in replicas}  # all on one node (node0 unless it had no room)
    assert ask(master, PutRevoke(keys), credential) == OkReply()
    daemon_ticket = ticket(cluster, alice)
    for key, replica in zip(keys, replicas, strict=True):
        write = WriteSlices([key], [replica.offset], [size], [0], [64 << 10], [replica.seal])
        with pytest.raises(PermissionDenied, match="was given up"):
            ask(replica.address, write, daemon_ticket, bytes(64 << 10))
    began = time.monotonic()
    with Store.connect(master, ClientConfig(token=bob, transport="tcp", grant_bytes=0)) as store:
        for i in range(10):
            assert store.put(f"after-{i}", bytes([i]) * size, PutOptions(preferred_node=node)) is PutStatus.STORED
        assert store.get("after-9") == bytes([9]) * size
    print(f"bob's ten 1 MiB puts to {node} after the attack: {time.monotonic() - began:.2f} s")


def test_concurrent_puts_stay_within_the_quota_and_never_evict_another_tenant(cluster: LocalCluster) -> None:
    """16 connections of one tenant each sending PutStart of 8 x 1 MiB at one barrier while the pool
    was full used to reserve 98 MiB against an 8 MiB quota (every one of them checked the quota
    before any had placed its keys) and evict all of another tenant's blocks. What a tenant's
    requests are placing now counts against its quota from the moment each is admitted, and a
    tenant's put evicts only its own blocks: with room in the pool it gets its quota, no more; with
    the pool full of the other tenant's blocks it gets a refusal that says so, and the other keeps
    every block."""
    quota, size = 8 << 20, 1 << 20
    alice, bob = cluster.add_tenant("crowd", quota=quota), cluster.add_tenant("resident")
    bob_client = ClientConfig(token=bob, transport="tcp", grant_bytes=0)
    credential = tenant_credential(alice)

    def attack(tag: str) -> tuple[int, list[str]]:
        """(bytes reserved, refusals' texts) of 16 concurrent PutStarts of 8 x 1 MiB."""
        barrier, answered, granted, refused = threading.Barrier(16), threading.Barrier(16), [], []

        def one(n: int) -> None:
            keys = [f"crowd-{tag}-{n}-{i}" for i in range(8)]
            sock, _ = raw(cluster.master_address, credential)
            with sock:
                barrier.wait(10)
                send_message(sock, PutStart(keys, [size] * 8, 1, None, False), next(REQUEST_IDS))
                reply = recv_message(sock)[1]
                assert isinstance(reply, PutStartReply), reply
                # Given up once all have their answers (a revoke before that would give its room to
                # a request still being placed): what was reserved leaves the quota for the next attack.
                answered.wait(30)
                send_message(sock, PutRevoke(keys), next(REQUEST_IDS))
                assert recv_message(sock)[1] == OkReply()
            granted.append(sum(size for t in reply.tickets() if t.status == "ok"))
            refused.extend(t.error for t in reply.tickets() if t.status == "error")

        threads = [threading.Thread(target=one, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(granted) == 16
        return sum(granted), refused

    with Store.connect(cluster.master_address, bob_client) as store:
        half = [f"resident-{i}" for i in range(24)]  # the pool (2 x 32 MiB) has room left
        for key in half:
            assert store.put(key, key.encode().ljust(16) * (size // 16)) is PutStatus.STORED
    reserved, _ = attack("room")
    print(f"16 concurrent PutStarts of 8 x 1 MiB under an 8 MiB quota: {reserved / size:.0f} MiB reserved")
    assert 0 < reserved <= quota
    with Store.connect(cluster.master_address, bob_client) as store:
        assert all(store.exists_many(half))
        held = [f"resident-full-{i}" for i in range(80)]  # more than the pool's 64 MiB: it is full, to the byte
        for key in held:
            store.put(key, key.encode().ljust(16) * (size // 16))
        before = [k for k, there in zip(half + held, store.exists_many(half + held), strict=True) if there]
    reserved, refused = attack("full")
    print(f"the same on a pool full of the other tenant's blocks: {reserved / size:.0f} MiB reserved")
    with Store.connect(cluster.master_address, bob_client) as store:
        after = sum(store.exists_many(before))
    print(f"the other tenant's blocks: {len(before)} before, {after} after")
    assert after == len(before)  # only the room bob's own evictions left free (headroom) went to alice
    assert reserved <= (64 << 20) - len(before) * size
    # Refused as full of others' blocks, or (while her other requests' reservations are pending) retry later.
    assert refused and all("evicts only its own" in t or "being written" in t or "quota" in t for t in refused)


def test_frames_in_flight_are_capped_per_tenant_on_the_master_and_each_daemon(cluster: LocalCluster) -> None:
    """Each connection's frame had its own limits (size, frame_timeout_s), but one token's many
    sessions could each hold a frame's worth at once (512 x 64 MiB). A tenant's frames begun and not
    finished count together against its max_inflight_bytes, on the master and on each daemon: the
    connection that takes it past the cap is answered QuotaExceeded and closed at once, long before
    the frame's deadline; the others, and other tenants, go on."""
    greedy, other = cluster.add_tenant("greedy"), cluster.add_tenant("patient")
    assert cluster.tenants_file is not None
    set_tenant(cluster.tenants_file, "greedy", max_inflight_bytes=3 << 20)
    credential = ticket(cluster, greedy)
    time.sleep(1.0)  # the master reads the tenants file again within a tick; daemons hear within seconds
    # The master counts the bytes it holds of each frame (1 + 1 + 2 MiB of 8 MiB frames); a daemon a
    # large frame's announced length before reading it (1 + 1 + 2 MiB frames, half sent): 4 MiB > 3.
    targets = ((cluster.master_address, tenant_credential(greedy), [8 << 20] * 3, [1 << 20, 1 << 20, 2 << 20]),
               (cluster.daemon_addresses[0], credential, [1 << 20, 1 << 20, 2 << 20], [512 << 10] * 3))  # fmt: skip
    for address, proof, lengths, sent in targets:
        deadline = time.monotonic() + 15
        while True:
            held = [raw(address, proof)[0] for _ in range(3)]
            try:
                for sock, length, n in zip(held, lengths, sent, strict=True):
                    sock.sendall(FRAME_HEADER.pack(length) + bytes(n))
                over = held[2]
                over.settimeout(FRAME_TIMEOUT_S / 2)
                try:
                    reply = recv_message(over)[1]
                except (OSError, KVStoreError, NoRequest):
                    reply = None
                if isinstance(reply, ErrorReply) or time.monotonic() > deadline:
                    break
            finally:
                for sock in held:
                    sock.close()
            time.sleep(0.5)  # a daemon that has not heard the master's word yet
        assert isinstance(reply, ErrorReply) and "max_inflight_bytes" in reply.message, (address, reply)
        assert isinstance(ask(cluster.master_address, Stats(), tenant_credential(other)), StatsReply)
    with Store.connect(cluster.master_address, ClientConfig(token=greedy, transport="tcp")) as store:
        assert store.put("small", b"x" * 4096) is PutStatus.STORED and store.get("small") == b"x" * 4096


def test_one_token_cannot_hold_every_session(cluster: LocalCluster) -> None:
    """4,090 master sessions (and 1,022 daemon sessions) of one tenant used to lock every other
    tenant out: each tenant has at most max_sessions open at once, on the master and on each daemon."""
    hog, other = cluster.add_tenant("hog"), cluster.add_tenant("bystander")
    assert cluster.tenants_file is not None
    set_tenant(cluster.tenants_file, "hog", max_sessions=4)
    master = cluster.master_address
    credential = ticket(cluster, hog)  # for the daemons, taken before the master's sessions are all held
    held = []
    try:
        time.sleep(1.0)  # the master reads the tenants file again within a tick
        held += [raw(master, tenant_credential(hog))[0] for _ in range(4)]
        with pytest.raises(QuotaExceeded, match="max_sessions 4"):
            raw(master, tenant_credential(hog))
        deadline = time.monotonic() + 15  # daemons hear the master's policy within seconds
        assert isinstance(ask(master, Stats(), tenant_credential(other)), StatsReply)  # others still log in
        daemon = cluster.daemon_addresses[0]
        while True:
            on_daemon = [raw(daemon, credential)[0] for _ in range(4)]
            held += on_daemon
            fifth = raw(daemon, credential)[0]  # the daemon proves the ticket, then refuses the session
            with fifth:
                send_message(fifth, Stats(), next(REQUEST_IDS))
                try:
                    reply = recv_message(fifth)[1]
                except KVStoreError:
                    reply = None
            if isinstance(reply, ErrorReply) and "max_sessions 4" in reply.message:
                break
            assert time.monotonic() < deadline, f"a fifth daemon session of a tenant capped at 4 was taken: {reply}"
            for sock in on_daemon:
                sock.close()
            time.sleep(0.5)
        bystander = ticket(cluster, other)
        sock = raw(daemon, bystander)[0]
        sock.close()
    finally:
        for sock in held:
            sock.close()


def test_tiny_pinned_objects_cost_an_index_slot_each_and_caps_hold(cluster: LocalCluster) -> None:
    """262,136 pinned 1-byte blocks used to fill a node's whole index for 262 KB of quota: a key is
    charged at least an index slot's worth (256 B), and a tenant's keys and pins can be capped."""
    quota = 1 << 20
    flood = cluster.add_tenant("flooder", quota=quota)
    master, credential = cluster.master_address, tenant_credential(flood)
    ok = 0
    for batch in range(2):
        keys = [f"tiny-{batch}-{i}" for i in range(MAX_BATCH_KEYS)]
        reply = ask(master, PutStart(keys, [1] * len(keys), 1, None, True), credential)
        assert isinstance(reply, PutStartReply)
        ok += sum(t.status == "ok" for t in reply.tickets())
        refused = [t for t in reply.tickets() if t.status == "error"]
        assert all(t.error_code == QuotaExceeded.code and "charged 256" in t.error for t in refused)
    assert ok == quota // 256  # 4,096 keys of one byte fill a 1 MiB quota
    capped = cluster.add_tenant("capped")
    assert cluster.tenants_file is not None
    set_tenant(cluster.tenants_file, "capped", max_objects=120, max_pinned=100)
    time.sleep(1.0)  # the master reads the tenants file again within a tick
    credential = tenant_credential(capped)
    pinned = ask(master, PutStart([f"p{i}" for i in range(150)], [64] * 150, 1, None, True), credential)
    assert isinstance(pinned, PutStartReply)
    statuses = [t.status for t in pinned.tickets()]
    assert statuses == ["ok"] * 100 + ["error"] * 50
    assert "max_pinned" in pinned.tickets()[100].error
    loose = ask(master, PutStart([f"u{i}" for i in range(50)], [64] * 50, 1, None, False), credential)
    assert isinstance(loose, PutStartReply)
    assert [t.status for t in loose.tickets()] == ["ok"] * 20 + ["error"] * 30
    assert "max_objects" in loose.tickets()[20].error


def test_a_tenant_given_two_replicas_gets_them_whatever_its_clients_ask(cluster: LocalCluster) -> None:
    """An operator gives a tenant two copies a put (`kvstore tenants set-caps --replicas 2`): its
    clients' puts get them, one-key puts and cached ones included (grants, one copy, are refused to
    it and the client puts the two-trip way); another tenant's puts get what its client asks."""
    token = cluster.add_tenant("careful")
    assert cluster.tenants_file is not None
    set_tenant(cluster.tenants_file, "careful", replicas=2)
    time.sleep(1.0)  # the master reads the tenants file again within a tick
    credential = tenant_credential(token)
    with pytest.raises(InvalidArgument, match="2 copies"):
        ask(cluster.master_address, GrantSpace(1 << 20, None), credential)
    config = ClientConfig(token=token, transport="tcp", replicas=1, put_mode="cached")
    with Store.connect(cluster.master_address, config) as store:
        assert store.put("one", b"1" * 4096) == PutStatus.STORED
        assert store.put_many([(f"k{i}", bytes([i]) * 4096) for i in range(8)]) == [PutStatus.STORED] * 8
        assert store.put("asked-one", b"a" * 4096, PutOptions(replicas=1, mode="visible")) == PutStatus.STORED
        keys = ["one", "asked-one"] + [f"k{i}" for i in range(8)]  # the master reads them under careful/
        reply = ask(cluster.master_address, GetReplicas(keys, [], False), credential)
        assert isinstance(reply, GetReplicasReply)
        assert all(loc is not None and len(loc.replicas) == 2 for loc in reply.located(keys))
    other = ClientConfig(token=cluster.add_tenant("loose"), transport="tcp")
    with Store.connect(cluster.master_address, other) as store:  # another tenant: as its client asks
        assert store.put("one", b"1" * 4096) == PutStatus.STORED
        reply = ask(cluster.master_address, GetReplicas(["one"], [], False), tenant_credential(other.token))
        assert isinstance(reply, GetReplicasReply)
        [loc] = reply.located(["one"])
        assert loc is not None and len(loc.replicas) == 1

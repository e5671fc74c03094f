"""Tenants, second round (issue 27), on a real cluster that authenticates: grants count against the
quota and are capped, a removed or narrowed tenant's open sessions end or narrow within seconds on
the master and on the daemons, a rotated token is taken for its grace and no longer, and nothing
holds a daemon's slot without logging in. Each test fails on the code before these changes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from bench.frames import ask
from kvstore.auth import open_ticket, tenant_credential
from kvstore.config import ClientConfig
from kvstore.errors import AuthFailed, KVStoreError, PermissionDenied, QuotaExceeded
from kvstore.keys import checksum
from kvstore.protocol import (
    CommitBlocks,
    ErrorReply,
    GetTicket,
    GrantReply,
    GrantSpace,
    Message,
    PutEnd,
    PutEndReply,
    PutStart,
    PutStartReply,
    Remove,
    TicketReply,
    WriteBlocks,
    WriteReply,
)
from kvstore.tenants import remove_tenant, rotate_tenant, set_tenant
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from transfer.auth import authenticate
from transfer.wire import connect, recv_message, send_message

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="16MiB", authenticate=True, admin=True) as c:
        yield c


def _client(cluster: LocalCluster, token: str) -> Store:
    return Store.connect(cluster.master_address, ClientConfig(token=token, transport="tcp", timeout_s=5.0))


def _grants(cluster: LocalCluster, token: str, length: int, times: int) -> tuple[int, list[str]]:
    """Ask the master for ``times`` grants of ``length`` bytes on one connection, as raw frames:
    the bytes granted, and the refusals."""
    sock = connect(cluster.master_address, 5.0)
    granted, refusals = 0, []
    with sock:
        authenticate(sock, tenant_credential(token), "test")
        for i in range(times):
            send_message(sock, GrantSpace(length, None), 5000 + i)
            reply: Message = recv_message(sock)[1]
            if isinstance(reply, GrantReply):
                granted += reply.length
            else:
                assert isinstance(reply, ErrorReply)
                refusals.append(reply.to_error().__class__.__name__)
    return granted, refusals


def test_grants_count_against_the_quota_and_spare_other_tenants(cluster: LocalCluster) -> None:
    bob = cluster.add_tenant("grant-bob", quota=4 * MiB)
    alice = cluster.add_tenant("grant-alice", quota=2 * MiB)
    blocks = [(f"b{i}", bytes([i]) * (64 * KiB)) for i in range(32)]
    with _client(cluster, bob) as b:
        b.put_many(blocks)
    # Holding nothing, alice asks for far more than the cluster's 32 MiB, a grant at a time.
    granted, refusals = _grants(cluster, alice, 8 * MiB, 200)
    assert granted <= 2 * MiB, f"{granted} bytes granted over a 2 MiB quota"
    assert refusals and set(refusals) == {"QuotaExceeded"}, refusals
    with _client(cluster, bob) as b:
        assert b.get_many([k for k, _ in blocks]) == [v for _, v in blocks]  # none of bob's evicted


def test_a_tenant_without_a_quota_still_has_its_open_grants_capped(cluster: LocalCluster) -> None:
    carol = cluster.add_tenant("grant-carol")
    granted, refusals = _grants(cluster, carol, 4 * KiB, 40)
    assert granted == 16 * 4 * KiB and refusals == ["QuotaExceeded"] * 24, (granted, refusals)


def _until(deadline_s: float, op: Callable[[], object]) -> tuple[int, float | None]:
    """Run ``op`` over and over for ``deadline_s``: how many runs succeeded, and when the last did."""
    start, ok, last = time.monotonic(), 0, None
    while time.monotonic() - start < deadline_s:
        try:
            op()
            ok += 1
            last = time.monotonic() - start
        except KVStoreError:
            pass
        time.sleep(0.02)
    return ok, last


@pytest.mark.slow
def test_removing_a_tenant_ends_its_open_sessions_on_master_and_daemons(cluster: LocalCluster) -> None:
    assert cluster.tenants_file is not None
    token = cluster.add_tenant("leaving", quota=1 * MiB)
    with _client(cluster, token) as s:
        s.put("kept", b"k" * (16 * KiB))
        assert s.get("kept") is not None  # a ticket and a daemon session are open now
        remove_tenant(cluster.tenants_file, "leaving")
        counter = iter(range(10**6))
        puts = _until(3.0, lambda: s.put(f"after-{next(counter)}", b"p" * (16 * KiB)))
        gets = _until(3.0, lambda: s.get("kept") or (_ for _ in ()).throw(KVStoreError("miss")))
    assert puts[1] is None or puts[1] < 1.5, f"puts went on {puts[1]} s after the removal ({puts[0]} of them)"
    assert gets[0] == 0, f"{gets[0]} reads served to a removed tenant"
    with pytest.raises(AuthFailed):
        _client(cluster, token).put("again", b"x")


def test_narrowing_a_tenant_reaches_its_open_session(cluster: LocalCluster) -> None:
    assert cluster.tenants_file is not None
    token = cluster.add_tenant("narrowed")
    with _client(cluster, token) as s:
        s.put("before", b"b" * (8 * KiB))
        set_tenant(cluster.tenants_file, "narrowed", operations=("read",))
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                s.put(f"w{time.monotonic()}", b"w" * KiB)
            except PermissionDenied:
                break
            time.sleep(0.05)
        else:
            pytest.fail("a narrowed tenant's open session still writes after 3 s")
        assert s.get("before") == b"b" * (8 * KiB)  # reads still allowed


def test_a_rotated_token_is_taken_for_its_grace_only(cluster: LocalCluster) -> None:
    assert cluster.tenants_file is not None
    old = cluster.add_tenant("rotating")
    with _client(cluster, old) as s:
        s.put("r", b"r" * KiB)
        new = rotate_tenant(cluster.tenants_file, "rotating", grace_s=60)
        time.sleep(0.5)
        assert s.get("r") == b"r" * KiB  # within the grace: the old session goes on
        with _client(cluster, new) as n:
            assert n.get("r") == b"r" * KiB
        rotate_tenant(cluster.tenants_file, "rotating", grace_s=0)  # the grace of the first ends at once
        time.sleep(1.0)
        with pytest.raises(AuthFailed):
            s.put("r2", b"x" * KiB)
    with pytest.raises(AuthFailed):
        _client(cluster, old).get("r")


@pytest.mark.slow
def test_a_daemon_cuts_a_connection_that_trickles_its_login(cluster: LocalCluster) -> None:
    sock = socket.create_connection(tuple(cluster.daemon_addresses[0].rsplit(":", 1)), timeout=30)  # type: ignore[arg-type]
    with sock:
        sock.sendall(b"\x00\x00\x01\x00")  # a frame header (256 bytes to come), then a byte now and then
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < 25:
            time.sleep(2)
            try:
                sock.sendall(b"\x91")
                sock.settimeout(0.05)
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - start < 15, "an unauthenticated connection held its slot"
    # The daemon counts it, and its heartbeats bring the count to the master's /metrics.
    token = cluster.add_admin("watcher")
    deadline = time.monotonic() + 10
    while True:
        metrics = _http(cluster.admin_address, "/metrics", token)
        counted = [line for line in metrics.splitlines()
                   if line.startswith("kvstore_daemon_refusals_total") and 'kind="login_timeouts"' in line
                   and not line.endswith(" 0.0")]  # fmt: skip
        if counted or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert counted, "the daemon's refusal of a late login is not in /metrics"


@pytest.mark.slow
def test_the_tenants_command_lists_rotates_sets_and_removes(cluster: LocalCluster) -> None:
    assert cluster.tenants_file is not None
    cluster.add_tenant("cli-tenant", quota=1 * MiB)

    def kvstore(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "kvstore_cli", "tenants", *args, "--file",
                               str(cluster.tenants_file)], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "cli-tenant" in kvstore("list")
    kvstore("set-quota", "cli-tenant", "--quota", "2MiB")
    assert "2097152" in kvstore("list")
    kvstore("set-caps", "cli-tenant", "--max-sessions", "8", "--max-pinned", "100")
    assert "8/-/100" in kvstore("list")
    token = kvstore("rotate", "cli-tenant", "--grace", "30").strip()
    assert token.startswith("cli-tenant.") and "rotated" in kvstore("list")
    with _client(cluster, token) as s:
        s.put("c", b"c")
    kvstore("remove", "cli-tenant")
    assert "cli-tenant" not in kvstore("list")
    with pytest.raises(QuotaExceeded if False else AuthFailed):
        _client(cluster, token).put("c2", b"c")


def test_the_admin_port_cuts_trickled_requests_and_caps_connections() -> None:
    env = {"KVSTORE_MASTER_ADMIN_HEADER_TIMEOUT_S": "1.5", "KVSTORE_MASTER_ADMIN_MAX_CONNECTIONS": "4"}
    with LocalCluster(1, dram="16MiB", admin=True, env=env) as c:
        assert c.admin_address is not None
        host, port = c.admin_address.rsplit(":", 1)
        trickler = socket.create_connection((host, int(port)), timeout=10)
        with trickler:
            trickler.sendall(b"GET /api/v1/health HTTP/1.1\r\n")
            start = time.monotonic()
            closed_after = None
            while time.monotonic() - start < 8:
                try:
                    trickler.sendall(b"X")  # a header a byte at a time: never finished
                    trickler.settimeout(0.3)
                    if trickler.recv(1024) == b"":
                        closed_after = time.monotonic() - start
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - start
                    break
            assert closed_after is not None and closed_after < 4, closed_after
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4)]
        try:
            time.sleep(0.2)
            extra = socket.create_connection((host, int(port)), timeout=5)
            with extra:
                extra.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert extra.recv(64).startswith(b"HTTP/1.1 503"), "a connection over the cap was served"
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 5
        while True:  # the server sees the held connections go a moment later
            try:
                metrics = _http(c.admin_address, "/metrics")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert (
            "kvstore_admin_header_timeouts_total 1.0" in metrics
            and "kvstore_admin_refused_connections_total" in metrics
        )


def _http(address: str, path: str, token: str = "") -> str:
    import urllib.request

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(f"http://{address}{path}", headers=headers), timeout=10) as r:
        return r.read().decode()


def test_a_reservation_is_written_once(cluster: LocalCluster) -> None:
    """Issue 27's replay: put, commit, remove, then the same sealed WriteBlocks again. It used to
    leave an orphan block the master did not know; now the daemon refuses the used seal."""
    token = cluster.add_tenant("sealer")
    credential = tenant_credential(token)
    sock = connect(cluster.master_address, 5.0)
    with sock:
        key = authenticate(sock, credential, "test")
        send_message(sock, GetTicket(), 1)
        reply = recv_message(sock)[1]
    assert isinstance(reply, TicketReply)
    ticket = open_ticket(reply, key, "sealer")
    reserved = ask(cluster.master_address, PutStart(["once"], [4], 1, None, False), credential)
    assert isinstance(reserved, PutStartReply) and reserved.seals
    [placed] = reserved.tickets()
    [replica] = placed.replicas
    data = b"once"
    write = WriteBlocks(["once"], [replica.offset], [4], [checksum(data)], False, [replica.seal])
    first = ask(replica.address, write, ticket, data)
    assert isinstance(first, WriteReply) and first.codes == [0], first
    assert ask(cluster.master_address, PutEnd(["once"], [checksum(data)]), credential) == PutEndReply([True])
    ask(cluster.master_address, Remove(["once"]), credential)
    with pytest.raises(PermissionDenied, match="written already"):
        again = ask(replica.address, write, ticket, b"evil")
        if isinstance(again, WriteReply) and again.codes[0]:
            raise KVStoreError(again.errors[0])


def test_a_tenants_stats_are_its_own(cluster: LocalCluster) -> None:
    token = cluster.add_tenant("counted", quota=1 * MiB)
    other = cluster.add_tenant("uncounted")
    with _client(cluster, other) as o:
        o.put_many([(f"o{i}", b"o" * KiB) for i in range(5)])
    with _client(cluster, token) as s:
        s.put_many([(f"c{i}", b"c" * KiB) for i in range(3)])
        stats = s.stats()
    assert stats["objects"] == 3 and stats["bytes"] == 3 * KiB and stats["quota_bytes"] == MiB, stats
    assert "dram_used" not in stats and "hits" not in stats and "rpc_errors" not in stats, stats


def test_tenants_write_through_the_socket_not_the_shared_arena(cluster: LocalCluster) -> None:
    token = cluster.add_tenant("same-host")
    block = b"s" * (64 * KiB)
    with Store.connect(cluster.master_address, ClientConfig(token=token, transport="auto", timeout_s=5.0)) as s:
        s.put("via-socket", block)  # the client maps the arena read-only and writes through the daemon
        assert s.get("via-socket") == block
    # A same-host tenant that maps the arena itself, copies its bytes in and asks for a commit in place:
    credential = tenant_credential(token)
    reserved = ask(cluster.master_address, PutStart(["in-place"], [4], 1, None, False), credential)
    assert isinstance(reserved, PutStartReply)
    [replica] = reserved.tickets()[0].replicas
    sock = connect(cluster.master_address, 5.0)
    with sock:
        key = authenticate(sock, credential, "test")
        send_message(sock, GetTicket(), 1)
        reply = recv_message(sock)[1]
    assert isinstance(reply, TicketReply)
    ticket = open_ticket(reply, key, "same-host")
    commit = CommitBlocks(["in-place"], [replica.offset], [4], [checksum(b"shm!")], False, [replica.seal])
    with pytest.raises(PermissionDenied, match="shared-memory writes"):
        answer = ask(replica.address, commit, ticket)
        if isinstance(answer, WriteReply) and answer.codes[0]:
            raise KVStoreError(answer.errors[0])

"""Who may touch what, on a real cluster that authenticates (a master and two daemons started with a
cluster secret and a tenants file): each attack of issue 13 is tried, without credentials, with
another tenant's, with a replayed handshake and with forged tickets, and must fail to do harm. The
table of attacks and outcomes goes to the output."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.frames import ask, raw
from bench.frames import ticket as tenant_ticket
from kvstore.auth import Credential, cluster_credential, read_secret_file, tenant_credential
from kvstore.config import ClientConfig
from kvstore.errors import AuthFailed, KVStoreError, PermissionDenied, QuotaExceeded
from kvstore.keys import checksum
from kvstore.protocol import (
    AuthHello,
    CommitBlocks,
    DropBlocks,
    ErrorReply,
    Exists,
    FetchBlocks,
    GetReplicas,
    GetReplicasReply,
    GrantReply,
    GrantSpace,
    MasterHello,
    Message,
    PutStart,
    PutStartReply,
    ReadBlocks,
    RegisterNode,
    Remove,
    Stats,
    WriteBlocks,
    WriteGranted,
)
from kvstore.results import PutStatus
from kvstore_cli.cluster import LocalCluster
from kvstore_client import PutOptions, Store
from tests.conftest import admin_call
from transfer.wire import connect, recv_message

VALUE = b"alice's secret prefix " * 400


OPERATOR_TOKEN = "operator-token-of-the-test"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="16MiB", authenticate=True, admin=True,
                      env={"KVSTORE_ADMIN_TOKEN": OPERATOR_TOKEN}) as c:  # fmt: skip
        yield c


def test_attacks_fail_to_do_harm(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    alice_token = cluster.add_tenant("alice")
    bob_token = cluster.add_tenant("bob")
    reader_token = cluster.add_tenant("reader", operations=("read",))
    assert cluster.secret_file is not None
    admin = cluster_credential(read_secret_file(cluster.secret_file))
    master, daemon = cluster.master_address, cluster.daemon_addresses[0]
    rows: list[tuple[str, str]] = []

    with Store.connect(master, ClientConfig(token=alice_token, transport="tcp")) as alice:
        alice.put_many([("prefix-1", VALUE), ("prefix-2", VALUE)])
    where = ask(master, GetReplicas(["alice/prefix-1"], [], False), admin)
    assert isinstance(where, GetReplicasReply)
    node_index = cluster.daemon_addresses.index(where.addresses[0])
    victim_daemon = cluster.daemon_addresses[node_index]

    def refused(name: str, attack: Callable[[], object], error: type[KVStoreError] = AuthFailed) -> None:
        try:
            outcome = attack()
        except _NoHarm as exc:
            rows.append((name, f"no harm: {exc}"))
            return
        except error as exc:
            rows.append((name, f"refused: {type(exc).__name__}: {str(exc)[:70]}"))
            return
        except (KVStoreError, OSError) as exc:
            rows.append((name, f"refused: {type(exc).__name__}"))
            return
        rows.append((name, f"NOT REFUSED: {outcome!r}"[:100]))

    # No credentials at all.
    for message in [Stats(), GetReplicas(["alice/prefix-1"], [], False), Exists(["alice/prefix-1"]),
                    Remove(["alice/prefix-1"])]:  # fmt: skip
        refused(f"no credentials: {type(message).__name__} to the master", lambda m=message: ask(master, m))
    refused("no credentials: ReadBlocks to a daemon",
            lambda: ask(victim_daemon, ReadBlocks(["alice/prefix-1"], ["dram"], [0], [len(VALUE)])))  # fmt: skip
    refused("no credentials: DropBlocks to a daemon", lambda: ask(victim_daemon, DropBlocks(["alice/prefix-1"])))
    refused("no credentials: MasterHello(epoch 10**9) to a daemon", lambda: ask(daemon, MasterHello(10**9)))
    refused("no credentials: FetchBlocks to a daemon",
            lambda: ask(daemon, FetchBlocks("10.1.2.3:9", ["x"], [0], [64], [0])))  # fmt: skip
    registration = RegisterNode("node0", "127.0.0.1:1", 1 << 20, 0, 64, [], [], "h", "", 0, [], False, "", 0, [])
    refused("no credentials: RegisterNode as node0 from another address", lambda: ask(master, registration))
    refused(
        "no credentials: WriteBlocks over alice's extent",
        lambda: ask(victim_daemon, WriteBlocks(["evil"], [0], [4], [checksum(b"evil")], False), payload=b"evil"),
    )
    refused("wrong cluster secret", lambda: ask(master, Stats(), cluster_credential(b"w" * 32)))
    refused("alice's name with a made-up token", lambda: ask(master, Stats(), tenant_credential("alice." + "x" * 43)))

    # A replayed handshake: the frames of a good one, sent again on a new connection.
    def replay() -> Message:
        sock, _ = raw(master)
        recorded = _record_handshake(master, tenant_credential(alice_token))
        with sock:
            for frame in recorded:
                sock.sendall(frame)
            recv_message(sock)
            reply = recv_message(sock)[1]
        if isinstance(reply, ErrorReply):
            raise reply.to_error()
        return reply

    refused("replayed handshake of alice", replay)

    # Another tenant's credentials.
    with Store.connect(master, ClientConfig(token=bob_token, transport="tcp")) as bob:
        refused("bob: get alice's key", lambda: _expect_none(bob.get("prefix-1")))
        refused("bob: get alice's key by her full name", lambda: _expect_none(bob.get("alice/prefix-1")))
        refused(
            "bob: exists / match_prefix on alice's keys",
            lambda: _expect_none(bob.exists("prefix-1") or bob.match_prefix(["prefix-1", "prefix-2"]) or None),
        )
        refused("bob: remove alice's key", lambda: _expect_none(bob.remove("prefix-1") or None))
        bob.put("prefix-1", b"bob's bytes")
        assert bob.get("prefix-1") == b"bob's bytes"
    bob_ticket = tenant_ticket(cluster, bob_token)
    refused("bob's ticket: ReadBlocks of alice/prefix-1 on her daemon",
            lambda: _expect_miss(ask(victim_daemon, ReadBlocks(["alice/prefix-1"], ["dram"], [0], [len(VALUE)]),
                                      bob_ticket)))  # fmt: skip
    refused("bob's ticket: DropBlocks on a daemon", lambda: ask(victim_daemon, DropBlocks(["alice/prefix-1"]),
                                                                   bob_ticket), PermissionDenied)  # fmt: skip
    refused("bob's ticket: MasterHello to a daemon", lambda: ask(daemon, MasterHello(10**9), bob_ticket),
            PermissionDenied)  # fmt: skip
    refused("bob's token: RegisterNode as node0", lambda: ask(master, registration, tenant_credential(bob_token)),
            PermissionDenied)  # fmt: skip
    grant = ask(master, GrantSpace(4096, None), tenant_credential(alice_token))
    assert isinstance(grant, GrantReply)
    refused("bob's ticket: WriteGranted into alice's grant",
            lambda: _write_granted(grant, bob_ticket), PermissionDenied)  # fmt: skip
    # Squatting: a tenant's writes land only where the master reserved for it (its seal of the extent).
    alice_ticket = tenant_ticket(cluster, alice_token)
    reserved = ask(master, PutStart(["squat"], [4], 1, None, False), tenant_credential(alice_token))
    assert isinstance(reserved, PutStartReply) and reserved.seals, reserved
    [ticket] = reserved.tickets()
    [replica] = ticket.replicas
    evil = checksum(b"evil")

    def write(keys: list[str], offset: int, seals: list[bytes], credential: Credential) -> Message:
        reply = ask(replica.address, WriteBlocks(keys, [offset], [4], [evil], False, seals), credential, b"evil")
        codes = getattr(reply, "codes", [])
        if codes and codes[0]:
            raise KVStoreError(reply.errors[0])  # type: ignore[attr-defined]
        return reply

    refused("alice's ticket: WriteBlocks at a free offset, no seal",
            lambda: write(["free"], replica.offset + (1 << 20), [], alice_ticket), PermissionDenied)  # fmt: skip
    refused("alice's ticket: her seal, another offset",
            lambda: write(["squat"], replica.offset + 4096, [replica.seal], alice_ticket),
            PermissionDenied)  # fmt: skip
    refused("alice's ticket: her seal, another key",
            lambda: write(["other"], replica.offset, [replica.seal], alice_ticket), PermissionDenied)  # fmt: skip
    refused("bob's ticket: alice's seal",
            lambda: write(["squat"], replica.offset, [replica.seal], bob_ticket), PermissionDenied)  # fmt: skip
    refused("alice's ticket: CommitBlocks at a free offset, no seal",
            lambda: ask(replica.address, CommitBlocks(["free"], [replica.offset + (1 << 20)], [4], [evil], False),
                         alice_ticket), PermissionDenied)  # fmt: skip
    assert write(["squat"], replica.offset, [replica.seal], alice_ticket)  # the reservation itself: written

    forged = Credential("ticket", "alice", bob_ticket.key, bob_ticket.ticket.replace(b"bob", b"alice", 1))
    refused("bob's ticket renamed to alice's", lambda: ask(victim_daemon, Stats(), forged))
    stolen = Credential("ticket", "bob", b"k" * 32, bob_ticket.ticket)
    refused("bob's ticket without its session key (sniffed)", lambda: ask(victim_daemon, Stats(), stolen))
    refused("bob's token to a daemon (tickets only)", lambda: ask(daemon, Stats(), tenant_credential(bob_token)))

    with Store.connect(master, ClientConfig(token=reader_token, transport="tcp")) as reader:
        refused("read-only tenant: put", lambda: reader.put("k", b"v"), PermissionDenied)
        refused("read-only tenant: remove", lambda: reader.remove("k"), PermissionDenied)

    with capsys.disabled():
        width = max(len(name) for name, _ in rows)
        print("\n\nattack".ljust(width + 2), "outcome")
        for name, outcome in rows:
            print(name.ljust(width), " ", outcome)
    assert not [r for r in rows if r[1].startswith("NOT")], rows

    # No harm done: alice reads her bytes exact, her keys are hers, the nodes are the real ones.
    with Store.connect(master, ClientConfig(token=alice_token)) as alice:
        assert alice.get("prefix-1") == VALUE and alice.get("prefix-2") == VALUE
    with Store.connect(master, cluster.client_config()) as operator:
        assert operator.exists_many(["alice/prefix-1", "bob/prefix-1", "prefix-1"]) == [True, True, False]
        assert sorted(n.address for n in operator.nodes()) == sorted(cluster.daemon_addresses)


class _NoHarm(Exception):
    """An attack that was answered, with nothing of the victim's in the answer."""


def _expect_none(value: object) -> object:
    if value:
        return value
    raise _NoHarm("answered as for a key that does not exist (bob's namespace)")


def _expect_miss(reply: Message) -> object:
    sizes = getattr(reply, "sizes", [0])
    if sizes == [-1]:
        raise _NoHarm("a miss: the daemon read bob/alice/prefix-1")
    return reply


def _write_granted(grant: GrantReply, credential: Credential) -> Message:
    message = WriteGranted(grant.grant_id, ["x"], [grant.offset], [4], [checksum(b"evil")], False)
    reply = ask(grant.address, message, credential, b"evil")
    codes = getattr(reply, "codes", [])
    if codes and codes[0] == PermissionDenied.code:
        raise PermissionDenied(reply.errors[0])  # type: ignore[attr-defined]
    return reply


def _record_handshake(address: str, credential: Credential) -> list[bytes]:
    """The client's frames of a successful handshake, as an eavesdropper would have them."""
    from kvstore.auth import ClientHandshake
    from kvstore.protocol import encode

    sock = connect(address, 5.0)
    with sock:
        handshake = ClientHandshake(credential)
        hello = encode(handshake.hello(), 0)
        sock.sendall(hello)
        challenge = recv_message(sock)[1]
        proof = encode(handshake.proof(challenge), 0)
        sock.sendall(proof)
        recv_message(sock)
    return [hello, proof]


def test_the_admin_api_knows_roles_and_keeps_tenants_in_their_namespace(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    carol, dave = cluster.add_tenant("carol"), cluster.add_tenant("dave", operations=("read",))
    viewer, ops = cluster.add_admin("viewer", "read-only"), cluster.add_admin("ops", "operator")
    with Store.connect(cluster.master_address, ClientConfig(token=carol)) as c:
        c.put_many([("doc-1", b"c1"), ("doc-2", b"c2")])
    with Store.connect(cluster.master_address, cluster.client_config()) as operator:
        operator.put("dave/doc-1", b"d1")  # written for dave, who may only read
    rows: list[tuple[str, int, str]] = []

    def call(name: str, method: str, path: str, token: str | None, body: object = None, expect: int = 200) -> Any:
        status, answer = admin_call(cluster.admin_address, method, path, body, token)
        rows.append((name, status, str(answer.get("error", "")) if isinstance(answer, dict) else ""))
        assert status == expect, (name, status, answer)
        return answer

    # Tenants: their own keys, by their own names; nothing else.
    assert call("carol lists keys", "GET", "/api/v1/keys", carol)["keys"] == ["doc-1", "doc-2"]
    page = call("carol pages keys", "GET", "/api/v1/keys?limit=1", carol)
    assert page == {"keys": ["doc-1"], "next_cursor": "doc-1"}
    assert call("carol's next page", "GET", "/api/v1/keys?limit=1&cursor=doc-1", carol)["keys"] == ["doc-2"]
    assert call("carol describes her key", "GET", "/api/v1/keys/doc-1", carol)["key"] == "doc-1"
    call("carol describes dave's key", "GET", "/api/v1/keys/dave%2Fdoc-1", carol, expect=404)
    assert call("carol lists with dave's prefix", "GET", "/api/v1/keys?prefix=dave", carol)["keys"] == []
    call("carol reads the cluster summary", "GET", "/api/v1/cluster", carol, expect=403)
    call("carol lists nodes", "GET", "/api/v1/nodes", carol, expect=403)
    call("carol scrapes /metrics", "GET", "/metrics", carol, expect=403)
    call("carol drains a node", "POST", "/api/v1/nodes/node0/drain", carol, {}, expect=403)
    call("carol evicts a node's tier", "POST", "/api/v1/evict", carol, {"node_id": "node0", "tier": "dram"},
         expect=403)  # fmt: skip
    call("dave (read only) evicts his key", "POST", "/api/v1/evict", dave, {"key": "doc-1"}, expect=403)
    evicted = call("carol evicts every key she can name", "POST", "/api/v1/evict", carol, {"prefix": ""})
    assert evicted["evicted"] == 2
    assert call("dave lists his keys", "GET", "/api/v1/keys", dave)["keys"] == ["doc-1"]  # carol's evict spared it
    call("a made-up token of carol's name", "GET", "/api/v1/keys", "carol." + "x" * 43, expect=401)
    call("no token", "GET", "/api/v1/keys", None, expect=401)
    # Admins: read-only reads everything and changes nothing; an operator changes.
    call("read-only admin: cluster summary", "GET", "/api/v1/cluster", viewer)
    call("read-only admin: /metrics", "GET", "/metrics", viewer)
    assert "dave/doc-1" in call("read-only admin: every key", "GET", "/api/v1/keys", viewer)["keys"]
    call("read-only admin: evict", "POST", "/api/v1/evict", viewer, {"prefix": ""}, expect=403)
    call("read-only admin: drain", "POST", "/api/v1/nodes/node0/drain", viewer, {}, expect=403)
    assert call("operator admin: evict", "POST", "/api/v1/evict", ops, {"key": "dave/doc-1"})["evicted"] == 1
    # The eviction log: a tenant sees its own evictions by its own names, an admin every one.
    mine = call("carol reads the eviction log", "GET", "/api/v1/evictions", carol)["evictions"]
    assert sorted(e["key"] for e in mine) == ["doc-1", "doc-2"]
    assert [e["key"] for e in call("dave reads the eviction log", "GET", "/api/v1/evictions", dave)["evictions"]] == [
        "doc-1"
    ]  # fmt: skip
    every = call("read-only admin: the eviction log", "GET", "/api/v1/evictions", viewer)["evictions"]
    assert sorted(e["key"] for e in every) == ["carol/doc-1", "carol/doc-2", "dave/doc-1"]
    call("KVSTORE_ADMIN_TOKEN: nodes", "GET", "/api/v1/nodes", OPERATOR_TOKEN)

    with capsys.disabled():
        width = max(len(name) for name, _, _ in rows)
        print("\n\nadmin API call".ljust(width + 2), "status")
        for name, status, error in rows:
            print(name.ljust(width), " ", status, error)


def test_an_unauthenticated_cluster_refuses_a_client_that_brings_credentials(tmp_path: object) -> None:
    with LocalCluster(1, dram="8MiB") as plain:
        with pytest.raises(AuthFailed, match="does not authenticate"):
            ask(plain.master_address, Stats(), cluster_credential(b"x" * 32))
        with pytest.raises(AuthFailed, match="does not authenticate"):
            ask(plain.daemon_addresses[0], AuthHello("cluster", "cluster", b"n" * 16, b""))


def test_a_tenant_over_quota_evicts_its_own_blocks_then_is_refused(cluster: LocalCluster) -> None:
    KiB = 1024
    small = cluster.add_tenant("small", quota=256 * KiB)
    pinner = cluster.add_tenant("pinner", quota=128 * KiB)
    churn = cluster.add_tenant("churn")
    block = b"q" * (64 * KiB)
    with Store.connect(cluster.master_address, ClientConfig(token=pinner)) as p:
        p.put_many([("pinned-1", block), ("pinned-2", block)], PutOptions(pin=True))
        with pytest.raises(QuotaExceeded, match="past its quota of 131072 bytes"):
            p.put("pinned-3", block)  # its own blocks are pinned: nothing of its own to evict
    with Store.connect(cluster.master_address, ClientConfig(token=small)) as s:
        for i in range(12):
            assert s.put(f"block-{i}", block) is PutStatus.STORED  # each over-quota put evicts its own LRU
        held = [s.exists(f"block-{i}") for i in range(12)]
        assert held[-4:] == [True] * 4 and sum(held) == 4, held  # 256 KiB: the 4 most recent
        with pytest.raises(QuotaExceeded):
            s.put("too-big", b"x" * (300 * KiB))
    # Another tenant's churn through more than the cluster holds evicts by LRU, never a pinned block.
    with Store.connect(cluster.master_address, ClientConfig(token=churn)) as c:
        for i in range(80):
            c.put(f"churn-{i}", b"c" * (512 * KiB))
    with Store.connect(cluster.master_address, ClientConfig(token=pinner)) as p:
        assert p.get("pinned-1") == block and p.get("pinned-2") == block
    with Store.connect(cluster.master_address, cluster.client_config()) as operator:
        stats = operator.stats()
        assert operator.exists_many(["pinner/pinned-1", "pinner/pinned-2"]) == [True, True], stats
    # What each tenant holds against its quota, for the quota-pressure alert (docker/prometheus/alerts.yml).
    status, text = admin_call(cluster.admin_address, "GET", "/metrics", None, cluster.add_admin("scraper", "read-only"))
    assert status == 200
    assert 'kvstore_tenant_quota_bytes{tenant="pinner"} 131072.0' in text
    assert 'kvstore_tenant_held_bytes{tenant="pinner"} 131072.0' in text  # its two pinned blocks
    assert 'kvstore_tenant_quota_bytes{tenant="small"} 262144.0' in text
    assert 'quota_bytes{tenant="churn"}' not in text and 'held_bytes{tenant="churn"}' not in text  # no quota
    assert 'kvstore_tenant_requests_total{tenant="churn"}' in text  # its requests, for its operations per second
    assert "kvstore_room_refused_pinned_total" in text

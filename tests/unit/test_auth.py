"""The handshake's proofs, tickets, identities and the tenants file (kvstore.auth), without sockets."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kvstore import auth as auth_module
from kvstore.auth import (
    CLUSTER,
    Authority,
    ClientHandshake,
    Credential,
    Identity,
    ServerHandshake,
    cluster_credential,
    open_ticket,
    secret_from,
    tenant_credential,
)
from kvstore.errors import AuthFailed, ConfigError, InvalidArgument, InvalidKey, PermissionDenied
from kvstore.protocol import (
    AuthChallenge,
    AuthHello,
    AuthOk,
    AuthProof,
    DropBlocks,
    Exists,
    GetReplicas,
    PutStart,
    ReadBlocks,
    RegisterNode,
    Remove,
    Stats,
    decode_payload,
    encode,
)
from kvstore.tenants import Admin, add_admin, add_tenant, is_legacy, load_access, new_token, rotate_tenant, stored_key

SECRET = b"s" * 32


@pytest.fixture
def authority(tmp_path: Path) -> tuple[Authority, dict[str, str]]:
    tenants = tmp_path / "tenants.toml"
    tokens = {
        "alice": add_tenant(tenants, "alice", quota_bytes=1 << 20),
        "reader": add_tenant(tenants, "reader", operations=("read",)),
    }
    return Authority(SECRET, tenants), tokens


def handshake(authority: Authority, credential: Credential) -> tuple[Identity, bytes, bytes]:
    """Both halves, every message through the wire codec: (identity, server's key, client's key)."""

    def wire(m: object) -> object:
        return decode_payload(encode(m, 1)[4:])[1]  # type: ignore[arg-type]

    client, server = ClientHandshake(credential), ServerHandshake(authority)
    challenge = wire(server.challenge(wire(client.hello())))  # type: ignore[arg-type]
    identity, ok, server_key = server.verify(wire(client.proof(challenge)))  # type: ignore[arg-type]
    return identity, server_key, client.finish(wire(ok))  # type: ignore[arg-type]


def test_each_kind_of_credential_authenticates_and_both_ends_agree_a_key(authority: tuple[Authority, dict]) -> None:
    auth, tokens = authority
    identity, server_key, client_key = handshake(auth, cluster_credential(SECRET))
    assert identity == CLUSTER and server_key == client_key
    identity, server_key, client_key = handshake(auth, tenant_credential(tokens["alice"]))
    assert (identity.tenant, identity.prefix) == ("alice", "alice/") and server_key == client_key
    ticket = open_ticket(auth.issue_ticket(identity, server_key), client_key, "alice")
    daemon = Authority(SECRET)  # a daemon knows the secret only, no tenants
    identity, server_key, client_key = handshake(daemon, ticket)
    assert identity.tenant == "alice" and identity.operations == {"read", "write", "remove"}
    assert server_key == client_key


def test_wrong_credentials_are_refused(authority: tuple[Authority, dict], tmp_path: Path) -> None:
    auth = authority[0]
    with pytest.raises(AuthFailed, match="wrong cluster secret"):
        handshake(auth, cluster_credential(b"t" * 32))
    with pytest.raises(AuthFailed, match="unknown tenant or wrong token"):
        handshake(auth, tenant_credential("alice." + "x" * 43))  # alice's name, not her token
    with pytest.raises(AuthFailed, match="unknown tenant"):
        handshake(auth, tenant_credential("mallory." + "x" * 43))
    # The tenants file's stored key is not a credential: proving with it fails.
    stored = bytes.fromhex(load_access(tmp_path / "tenants.toml").tenants["alice"].stored_key.hex())
    with pytest.raises(AuthFailed):
        handshake(auth, Credential("tenant", "alice", stored))


def test_a_replayed_proof_is_refused(authority: tuple[Authority, dict]) -> None:
    auth, tokens = authority
    client, first = ClientHandshake(tenant_credential(tokens["alice"])), ServerHandshake(auth)
    hello = client.hello()
    proof = client.proof(first.challenge(hello))
    first.verify(proof)
    second = ServerHandshake(auth)  # a new connection: a new server nonce
    second.challenge(hello)
    with pytest.raises(AuthFailed):
        second.verify(proof)
    with pytest.raises(AuthFailed, match="expected the handshake's proof"):
        first.verify(proof)  # one proof per challenge


def test_a_server_that_cannot_prove_itself_is_refused() -> None:
    impostor = Authority(b"i" * 32)  # knows no secret of this cluster; claims any tenant exists
    client = ClientHandshake(cluster_credential(SECRET))
    server = ServerHandshake(impostor)
    challenge = server.challenge(client.hello())
    client.proof(challenge)
    with pytest.raises(AuthFailed, match="could not prove"):
        client.finish(AuthOk(b"\0" * 32))


def test_tickets_are_bound_to_tenant_secret_and_time(authority: tuple[Authority, dict]) -> None:
    auth, tokens = authority
    identity, server_key, client_key = handshake(auth, tenant_credential(tokens["reader"]))
    reply = auth.issue_ticket(identity, server_key)
    ticket = open_ticket(reply, client_key, "reader")
    daemon = Authority(SECRET)
    assert handshake(daemon, ticket)[0].operations == {"read"}
    with pytest.raises(AuthFailed, match="not this tenant's"):
        handshake(daemon, Credential("ticket", "alice", ticket.key, ticket.ticket))
    forged = ticket.ticket.replace(b"reader", b"readex")
    with pytest.raises(AuthFailed, match="not one this cluster's master issued"):
        handshake(daemon, Credential("ticket", "readex", ticket.key, forged))
    with pytest.raises(AuthFailed, match="not one this cluster's master issued"):
        handshake(Authority(b"o" * 32), ticket)  # another cluster's daemon
    old = open_ticket(auth.issue_ticket(identity, server_key, now_ms=0), client_key, "reader")
    with pytest.raises(AuthFailed, match="expired"):
        handshake(daemon, old)
    # Without the connection's key, the sealed session key is noise: a sniffer cannot use the ticket.
    stolen = open_ticket(reply, b"k" * 32, "reader")
    with pytest.raises(AuthFailed, match="wrong proof"):
        handshake(daemon, stolen)


def test_an_identity_allows_its_operations_and_scopes_its_keys() -> None:
    alice = Identity("alice", "alice", frozenset({"read", "write"}))
    alice.check(GetReplicas)
    alice.check(PutStart)
    with pytest.raises(PermissionDenied, match="not allowed to remove"):
        alice.check(Remove)
    for internal in (RegisterNode, DropBlocks):
        with pytest.raises(PermissionDenied, match="only the cluster"):
            alice.check(internal)
    assert alice.scope(Exists(["a", "b/c"])) == Exists(["alice/a", "alice/b/c"])
    read = ReadBlocks(["k"], ["dram"], [0], [1])
    assert alice.scope(read) == msgspec.structs.replace(read, keys=["alice/k"])
    assert alice.scope(Stats()) == Stats()
    with pytest.raises(InvalidKey, match="longer than 250 bytes"):
        alice.scope(Exists(["x" * 251]))
    CLUSTER.check(RegisterNode)
    assert CLUSTER.scope(Exists(["a"])) == Exists(["a"])


def test_the_tenants_file_is_checked_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    token = add_tenant(path, "alice", 100)
    auth = Authority(SECRET, path)
    assert auth.tenant("alice") is not None and auth.tenant("alice").quota_bytes == 100  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="exists already"):
        add_tenant(path, "alice")
    add_tenant(path, "bob")
    assert auth.tenant("bob") is not None  # read again: the file changed
    assert json.loads(path.read_text())["tenants"]["alice"]["token_ed25519"] != token
    path.write_text("{not json")
    assert auth.tenant("bob") is not None  # a file that turned bad keeps the last good tenants
    for text, match in [
        ('{"tenants": {"a b": {}}}', "tenant name"),
        ('{"tenants": {"a": {"token_sha256": "00"}}}', "64 hex digits"),
        ('{"tenants": {"a": {"token_sha256": "' + "0" * 64 + '", "quota_bytes": -1}}}', "quota_bytes"),
        ('{"tenants": {"a": {"token_sha256": "' + "0" * 64 + '", "operations": ["drain"]}}}', "operations"),
        ('{"tenants": {"a": {"token_sha256": "' + "0" * 64 + '", "colour": 1}}}', "unknown settings"),
        ('{"admins": {"a": {"token_sha256": "' + "0" * 64 + '", "role": "root"}}}', "role must be one of"),
        ('{"tenant": {}}', "unknown tables"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_access(path)
    with pytest.raises(ConfigError, match="cluster's own identity"):
        add_tenant(tmp_path / "other.toml", "cluster")


def test_admin_tokens_share_the_file_and_say_whose_they_are(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    alice = add_tenant(path, "alice", 100, ("read",))
    viewer = add_admin(path, "viewer")
    ops = add_admin(path, "alice", "operator")  # an admin may share a tenant's name: the token tells them apart
    auth = Authority(SECRET, path)
    assert isinstance(auth.bearer(viewer), Admin) and auth.bearer(viewer).role == "read-only"  # type: ignore[union-attr]
    assert auth.bearer(ops) == Admin("alice", stored_key(ops), "operator")
    assert auth.bearer(alice) == auth.tenant("alice") and auth.tenant("alice").quota_bytes == 100  # type: ignore[union-attr]
    assert auth.bearer("alice." + "x" * 43) is None and auth.bearer("no token") is None
    assert load_access(path).tenants.keys() == {"alice"}  # written as TOML and read back
    with pytest.raises(ConfigError, match="role"):
        add_admin(path, "root", "root")
    with pytest.raises(ConfigError, match=r"NAME\.SECRET"):
        tenant_credential("no-dot-in-it")
    with pytest.raises(ConfigError, match="at least 16"):
        secret_from(None, {"KVSTORE_CLUSTER_SECRET": "short"})
    assert secret_from(None, {}) is None


def test_a_malformed_hello_or_proof_is_refused(authority: tuple[Authority, dict]) -> None:
    auth, _ = authority
    with pytest.raises(AuthFailed, match="authentication required before Stats"):
        ServerHandshake(auth).challenge(Stats())
    with pytest.raises(AuthFailed, match="malformed"):
        ServerHandshake(auth).challenge(AuthHello("tenant", "alice", b"short", b""))
    with pytest.raises(AuthFailed, match="no ephemeral key"):
        ServerHandshake(auth).challenge(AuthHello("tenant", "alice", b"n" * 16, b""))
    server = ServerHandshake(auth)
    server.challenge(AuthHello("tenant", "alice", b"n" * 16, b"", b"e" * 32))
    with pytest.raises(AuthFailed):
        server.verify(AuthProof(b""))


def test_the_master_takes_no_ticket_as_a_login_and_one_hello_per_connection(
    authority: tuple[Authority, dict],
) -> None:
    auth, tokens = authority
    identity, server_key, client_key = handshake(auth, tenant_credential(tokens["alice"]))
    ticket = open_ticket(auth.issue_ticket(identity, server_key), client_key, "alice")
    with pytest.raises(AuthFailed, match="not tickets"):
        handshake(auth, ticket)  # a ticket outlives a tenant's removal: it must not renew itself
    server = ServerHandshake(auth)
    hello = ClientHandshake(tenant_credential(tokens["alice"])).hello()
    server.challenge(hello)
    with pytest.raises(AuthFailed, match="one AuthHello per connection"):
        server.challenge(hello)


def test_a_tenants_file_that_went_missing_then_bad_keeps_the_last_good_tenants(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    add_tenant(path, "alice")
    auth = Authority(SECRET, path)
    path.unlink()
    assert auth.tenant("alice") is not None
    path.write_text("[[[not toml")
    assert auth.tenant("alice") is not None


def test_seals_bind_a_tenant_to_the_extents_the_master_reserved() -> None:
    auth = Authority(SECRET)
    now = 1_000_000
    seal = auth.seal("alice", "node1", "alice/k", 4096, 512, now + 30_000)
    auth.check_seals("alice", "node1", ["alice/k"], [4096], [512], [seal], now)
    for tenant, node, key, offset, size, seals, match in [
        ("alice", "node1", "alice/k", 4096, 512, [], "reserved for it"),
        ("alice", "node2", "alice/k", 4096, 512, [seal], "no reservation"),
        ("alice", "node1", "alice/k", 8192, 512, [seal], "no reservation"),
        ("alice", "node1", "alice/k", 4096, 1024, [seal], "no reservation"),
        ("bob", "node1", "alice/k", 4096, 512, [seal], "no reservation"),
        ("alice", "node1", "alice/k", 4096, 512, [seal[:-1]], "no reservation"),
        ("alice", "node1", "alice/k", 4096, 512, [Authority(b"x" * 32).seal("alice", "node1", "alice/k", 4096, 512,
                                                                              now + 30_000)], "no reservation"),
    ]:  # fmt: skip
        with pytest.raises(PermissionDenied, match=match):
            auth.check_seals(tenant, node, [key], [offset], [size], seals, now)
    with pytest.raises(PermissionDenied, match="expired"):
        auth.check_seals("alice", "node1", ["alice/k"], [4096], [512], [seal], now + 30_000 + 61_000)
    with pytest.raises(InvalidArgument, match="malformed"):  # found by bench.fuzz: lists of other lengths
        auth.check_seals("alice", "node1", ["alice/k"], [4096, 0], [512], [seal], now)


def _recorded(authority: Authority, token: str) -> tuple[AuthHello, AuthChallenge, AuthProof, bytes]:
    """One handshake of ``token`` as an eavesdropper records it, and the key both ends agreed."""
    client, server = ClientHandshake(tenant_credential(token)), ServerHandshake(authority)
    hello = client.hello()
    challenge = server.challenge(hello)
    proof = client.proof(challenge)
    _, ok, key = server.verify(proof)
    assert client.finish(ok) == key
    return hello, challenge, proof, key


def test_a_stolen_tenants_file_and_a_recorded_handshake_log_nobody_in(
    authority: tuple[Authority, dict], tmp_path: Path
) -> None:
    """Issue 27, item 4: with the file's verifier and a recorded handshake, the old scheme gave the
    client key away (proof XOR HMAC(verifier, transcript)). The verifier is now a public key: the
    same recovery yields nothing that logs in, and nothing that is the session's key."""
    auth, tokens = authority
    stolen = load_access(tmp_path / "tenants.toml").tenants["alice"].stored_key
    hello, challenge, proof, session = _recorded(auth, tokens["alice"])
    transcript = auth_module._transcript(hello, challenge)
    recovered = auth_module._xor(proof.proof.ljust(32, b"\0"), auth_module._mac(stolen, b"client", transcript))
    for guess in (recovered, stolen, stolen[-32:]):
        with pytest.raises(AuthFailed):
            handshake(auth, Credential("tenant", "alice", guess))
        assert auth_module._mac(guess, b"connection", transcript) != session


def test_a_legacy_verifier_logs_in_is_flagged_and_rotation_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    token = new_token("old")
    path.write_text(json.dumps({"tenants": {"old": {"token_sha256": stored_key(token).hex()}}}))
    auth = Authority(SECRET, path)
    identity, server_key, client_key = handshake(auth, tenant_credential(token))
    assert identity.tenant == "old" and server_key == client_key
    tenant = auth.tenant("old")
    assert tenant is not None and is_legacy(tenant.stored_key)
    new = rotate_tenant(path, "old", grace_s=60)
    tenant = auth.tenant("old")
    assert tenant is not None and not is_legacy(tenant.stored_key) and is_legacy(tenant.previous_key)
    assert handshake(auth, tenant_credential(new))[0].tenant == "old"
    assert handshake(auth, tenant_credential(token))[0].tenant == "old"  # the old one, in its grace


def test_a_server_without_the_tenants_verifier_cannot_pass_for_the_master() -> None:
    """A tenant's session key came from the ephemeral exchange alone, so anyone in the middle could
    answer its login as the master. The server's proof now needs the token's verifier too."""
    client = ClientHandshake(tenant_credential(new_token("alice")))
    hello = client.hello()
    fake = X25519PrivateKey.generate()
    challenge = AuthChallenge(b"n" * 16, fake.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw), True)
    client.proof(challenge)
    transcript = auth_module._transcript(hello, challenge)
    shared = fake.exchange(X25519PublicKey.from_public_bytes(hello.ephemeral))
    for guess in (b"", auth_module._verifiers(b"another client key, not alice's")[0], b"\0" * 32):
        key = auth_module._session(shared, guess, transcript)
        with pytest.raises(AuthFailed, match="could not prove"):
            client.finish(AuthOk(auth_module._mac(key, b"server", transcript)))

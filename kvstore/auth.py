"""Who is at the other end of a connection: credentials, the handshake's proofs, tenants and tickets.

Pure: fed messages, knows no socket (:mod:`transfer.auth` runs the handshake over
connections). Three kinds of credential:

- the **cluster secret**, shared by the master, the daemons and operators' tools: identity
  ``cluster``, allowed everything, keys unscoped;
- a **tenant token** ``NAME.SECRET``, a client of tenant NAME. ``client_key = HMAC(token,
  "kvstore client key")`` seeds an Ed25519 signing key; the master keeps only its public half
  (the verifier). The client signs the handshake's transcript, and the connection's key comes
  from an X25519 exchange of ephemeral keys mixed with the verifier: a stolen tenants file,
  even with recorded handshakes, logs nobody in, and a server without the file cannot prove
  itself to the tenant. (Files written before keep ``sha256(client_key)``: still taken, with a
  SCRAM-style proof, and flagged: rotate them.)
- a **ticket**, the master's word to the daemons that its holder is tenant NAME until a
  time: ``NAME \\0 EXPIRES_MS \\0 RANDOM`` and its HMAC under a key derived from the cluster
  secret. Its session key (an HMAC of the ticket under that key) reaches the client masked
  with the key of the connection it asked on, and a daemon derives it itself: no tenant list
  on the daemons, and no key in clear on the wire.

The handshake, the first frames of a connection to a server that requires it (two round
trips, on connect only; pooled connections pay it once)::

    client -> AuthHello(kind, name, client nonce, ticket)
    server <- AuthChallenge(server nonce)
    client -> AuthProof(proof over the transcript)
    server <- AuthOk(server proof)   or ErrorReply(AuthFailed), and the server closes

The server's fresh nonce makes a replayed proof worthless; the server's proof (under a key only
the real server can derive: the cluster secret, the tenant's verifier, the ticket's key) lets
the client refuse an impostor; checks are constant-time (:func:`hmac.compare_digest`). The handshake
authenticates the peers, not each later frame: on an untrusted network, TLS keeps the stream
itself from being read or hijacked.

A tenant's keys live in its namespace ``NAME/``: the servers put that prefix in front of every
key a tenant's connection names (:meth:`Identity.scope`), so that it cannot name another's.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kvstore.errors import AuthFailed, ConfigError, InvalidArgument, InvalidKey, KVStoreError, PermissionDenied
from kvstore.keys import MAX_KEY_BYTES
from kvstore.protocol import (
    AdminInfo,
    AuthChallenge,
    AuthHello,
    AuthOk,
    AuthProof,
    ClearReplicas,
    CommitBlocks,
    Exists,
    FlushCommits,
    GetReplicas,
    GetTicket,
    GrantSpace,
    LabelBlocks,
    ListKeys,
    ListNodes,
    MatchPrefix,
    MatchPrefixNodes,
    Message,
    PutEnd,
    PutRevoke,
    PutStart,
    ReadBlocks,
    ReadSlices,
    ReleaseLeases,
    Remove,
    Replicate,
    ReportNode,
    ReturnGrants,
    Stats,
    TenantsPolicy,
    TicketReply,
    WriteBlocks,
    WriteGranted,
    WriteSlices,
)

log = logging.getLogger("kvstore.auth")

# The tenants file's side of it, re-exported: callers of this module name them from here.
from kvstore.tenants import (  # noqa: E402
    ED25519,
    MIN_SECRET_BYTES,
    OPERATIONS,
    TENANT_NAME,
    Access,
    Admin,
    Operation,
    Tenant,
    _mac,
    _split_token,
    client_key,
    is_legacy,
    key_fingerprint,
    legacy_verifier_of,
    load_access,
    signing_seed,
    stored_key,
    verifier,
    verifier_of,
)

_OPERATION_OF: dict[type[Message], Operation] = {
    GetReplicas: "read", ReleaseLeases: "read", MatchPrefix: "read", MatchPrefixNodes: "read", Exists: "read",
    Stats: "read", ListNodes: "read", AdminInfo: "read", GetTicket: "read", ReadBlocks: "read",
    ReadSlices: "read", ListKeys: "read", ReportNode: "read",
    PutStart: "write", PutEnd: "write", PutRevoke: "write", GrantSpace: "write", ReturnGrants: "write",
    Replicate: "write", WriteBlocks: "write", WriteGranted: "write", WriteSlices: "write", CommitBlocks: "write",
    FlushCommits: "write", LabelBlocks: "write",
    Remove: "remove", ClearReplicas: "remove",
}  # fmt: skip
"""What a tenant may be allowed, per request; a request not listed is the cluster's alone (a node
registering, the master's commands to daemons, a daemon's reports)."""


TICKET_SKEW_MS = 60_000
"""Clocks of the master and the daemons may differ by this much: a ticket is taken this long past its end."""

_NONCE_BYTES = 16
_SEAL_MAC = 16
_MAX_NAME = 64
_MAX_TICKET = 256
_TRANSCRIPT_TAG = b"kvstore-auth-1"


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


# -- identities ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Who a connection serves: the cluster (everything), a tenant (its operations, its namespace),
    or anyone (a server without authentication: everything, as before there was any)."""

    name: str
    tenant: str | None = None
    operations: frozenset[str] = frozenset(OPERATIONS)
    key_id: bytes = field(default=b"", repr=False)
    """What a tenant logged in with: its stored key (a master's session), or its ticket's issue
    time (a daemon's): a session whose credential the tenants file no longer accepts is over."""

    @property
    def prefix(self) -> str:
        return f"{self.tenant}/" if self.tenant is not None else ""

    def check(self, kind: type[Message]) -> None:
        """Raise PermissionDenied unless this identity may send a ``kind`` request."""
        if self.tenant is None:
            return
        operation = _OPERATION_OF.get(kind)
        if operation is None:
            raise PermissionDenied(f"tenant {self.tenant!r} may not send {kind.__name__}: only the cluster may")
        if operation not in self.operations:
            raise PermissionDenied(f"tenant {self.tenant!r} is not allowed to {operation} ({kind.__name__})")

    def admit(self, message: Message) -> Message:
        """``message`` as this identity may send it (:meth:`check`, then :meth:`scope`)."""
        self.check(type(message))
        return self.scope(message)

    def scope(self, message: Message) -> Message:
        """``message`` with its keys in this identity's namespace (itself for the cluster and anyone)."""
        if self.tenant is None or not hasattr(message, "keys"):
            return message
        prefix = self.prefix
        keys = [prefix + k if isinstance(k, str) else k for k in message.keys]
        for key in keys:
            if isinstance(key, str) and len(key.encode()) > MAX_KEY_BYTES:
                raise InvalidKey(
                    f"key {key[len(prefix) :][:40]!r}... is longer than {MAX_KEY_BYTES - len(prefix.encode())} bytes,"
                    f" the most a key of tenant {self.tenant!r} can be"
                )
        return msgspec.structs.replace(message, keys=keys)


ANYONE = Identity("anyone")
"""The identity of every connection to a server that does not authenticate."""
CLUSTER = Identity("cluster")


# -- credentials (what a client holds) ----------------------------------------------------------


@dataclass(frozen=True, repr=False)
class Credential:
    """What a client proves itself with: its kind and name as sent in AuthHello, and its key."""

    kind: Literal["cluster", "tenant", "ticket"]
    name: str
    key: bytes
    ticket: bytes = b""
    expires_ms: int = 0
    """A ticket's end (unix ms); 0 for the others."""

    def __repr__(self) -> str:  # never the key
        return f"Credential({self.kind}, {self.name!r})"


def cluster_key(secret: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the cluster secret is {len(secret)} bytes; it must be at least {MIN_SECRET_BYTES}")
    return _mac(secret, b"kvstore cluster key")


def cluster_credential(secret: bytes) -> Credential:
    return Credential("cluster", "cluster", cluster_key(secret))


def tenant_credential(token: str) -> Credential:
    name, _ = _split_token(token)
    return Credential("tenant", name, client_key(token))


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """A cluster secret from a file (surrounding whitespace stripped); ConfigError names what is wrong."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cluster secret file {path}: {exc.strerror or exc}") from None
    cluster_key(secret)  # checks its length
    return secret


def secret_from(path: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret: from ``path`` when given, else ``KVSTORE_CLUSTER_SECRET``, else None."""
    if path:
        return read_secret_file(path)
    value = (os.environ if environ is None else environ).get("KVSTORE_CLUSTER_SECRET", "").strip()
    if not value:
        return None
    cluster_key(value.encode())
    return value.encode()


# -- the client's half of the handshake --------------------------------------------------------------


def _transcript(hello: AuthHello, challenge: AuthChallenge) -> bytes:
    legacy = b"legacy" if challenge.legacy else b""
    return b"\0".join([_TRANSCRIPT_TAG, hello.kind.encode(), hello.name.encode(), hello.nonce, challenge.nonce,
                       hello.ticket, hello.ephemeral, challenge.ephemeral, legacy])  # fmt: skip


def _shared(private: X25519PrivateKey, peer: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer))
    except ValueError:
        raise AuthFailed("a malformed ephemeral key in the handshake") from None


def _session(shared: bytes, verifier: bytes, transcript: bytes) -> bytes:
    """A tenant connection's key: from the two ephemeral X25519 keys (nothing on the wire derives
    it) and the tenant's verifier (the server's proof under it shows the client a server that
    holds the tenants file: an impostor or a relay in the middle cannot make it), bound to the
    transcript."""
    return _mac(shared + verifier, b"kvstore tenant session", transcript)


def _verifiers(client: bytes) -> list[bytes]:
    """The verifiers a tenants file may keep of the token whose client key is ``client``: its
    Ed25519 public key, or (a file written before those) the legacy sha256."""
    return [verifier_of(client), legacy_verifier_of(client)]


class ClientHandshake:
    """One client connection's handshake: :meth:`hello`, then :meth:`proof` of the server's
    challenge, then :meth:`finish` with its AuthOk, which yields the connection's own key."""

    def __init__(self, credential: Credential) -> None:
        self.credential = credential
        self._ephemeral = X25519PrivateKey.generate() if credential.kind == "tenant" else None
        public = self._ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) if self._ephemeral else b""
        self._hello = AuthHello(
            credential.kind, credential.name, secrets.token_bytes(_NONCE_BYTES), credential.ticket, public
        )
        self._transcript = b""
        self._shared = b""
        self._legacy = False

    def hello(self) -> AuthHello:
        return self._hello

    def proof(self, challenge: Message) -> AuthProof:
        if not isinstance(challenge, AuthChallenge) or len(challenge.nonce) != _NONCE_BYTES:
            raise AuthFailed(f"the server answered the handshake with {type(challenge).__name__}, not a challenge")
        self._transcript = _transcript(self._hello, challenge)
        c = self.credential
        if c.kind == "tenant":
            assert self._ephemeral is not None
            if len(challenge.ephemeral) != 32:
                raise AuthFailed("the server's challenge carries no ephemeral key: not a server of this version")
            self._shared = _shared(self._ephemeral, challenge.ephemeral)
            self._legacy = challenge.legacy
            signature = Ed25519PrivateKey.from_private_bytes(signing_seed(c.key)).sign(self._transcript)
            # The legacy proof only when the server holds a legacy verifier of this tenant (see is_legacy).
            stored = legacy_verifier_of(c.key)
            legacy = _xor(c.key, _mac(stored, b"client", self._transcript)) if challenge.legacy else b""
            return AuthProof(legacy, signature)
        return AuthProof(_mac(c.key, b"client", self._transcript))

    def finish(self, ok: Message) -> bytes:
        """Check the server's proof; the key only this connection's two ends know."""
        if not isinstance(ok, AuthOk):
            raise AuthFailed(f"the server answered the proof with {type(ok).__name__}")
        if self._shared:  # a tenant: the server proves it holds this token's verifier
            candidates = _verifiers(self.credential.key)[: 2 if self._legacy else 1]
            keys = [_session(self._shared, v, self._transcript) for v in candidates]
        else:
            keys = [self.credential.key]
        for key in keys:
            if hmac.compare_digest(ok.proof, _mac(key, b"server", self._transcript)):
                return _mac(key, b"connection", self._transcript)
        raise AuthFailed("the server could not prove it knows this credential: not the server it claims to be")


def open_ticket(reply: TicketReply, connection_key: bytes, tenant: str) -> Credential:
    """The ticket credential in a master's TicketReply (its session key unmasked)."""
    if len(reply.sealed_key) != 32:
        raise AuthFailed("the master's ticket reply carries no session key")
    mask = _mac(connection_key, b"ticket", reply.ticket)
    return Credential("ticket", tenant, _xor(reply.sealed_key, mask), reply.ticket, reply.expires_ms)


# -- the server's half ---------------------------------------------------------------------------


class Authority:
    """What a server checks credentials against: the cluster secret (master and daemons) and, on the
    master, the tenants file (re-read when it changes, so that tenants are added without a restart)."""

    def __init__(self, secret: bytes, tenants_file: str | os.PathLike[str] | None = None,
                 ticket_ttl_ms: int = 3_600_000) -> None:  # fmt: skip
        self.cluster_key = cluster_key(secret)
        self._ticket_key = _mac(secret, b"kvstore ticket key")
        self.ticket_ttl_ms = ticket_ttl_ms
        self._tenants_file = Path(tenants_file) if tenants_file is not None else None
        self._access = Access({}, {})
        self._tenants_stamp: tuple[int, int] | None = None
        self._loaded = False
        self.file_error = ""
        """Why the tenants file last failed to load ("" once it loads): the last good one serves meanwhile."""
        self.file_errors = 0
        """Loads of the tenants file that failed since the start."""
        self.loads = 0
        """Loads of the tenants file that succeeded (a change that restores earlier contents counts:
        tickets issued in between must be refused, so daemons must hear of it)."""
        self._policy: dict[str, tuple[frozenset[str], frozenset[bytes]]] | None = None
        """A daemon's: per tenant, its operations and the fingerprints of its keys (the master's word)."""
        self._policy_as_of = 0
        self._session_caps: dict[str, int] = {}
        """A daemon's: each tenant's session cap, as the master's policy says."""
        self.default_max_sessions = 512
        """A tenant's session cap where nothing else says (a master sets its config's)."""
        self._inflight_caps: dict[str, int] = {}
        """A daemon's: each tenant's cap on bytes of frames in flight, as the master's policy says."""
        self.default_max_inflight = 256 << 20
        """A tenant's cap on bytes of frames in flight where nothing else says (a master sets its config's)."""
        self.refresh_tenants()

    @property
    def takes_tokens(self) -> bool:
        """Whether tenants log in here with their tokens (the master), or only show tickets (daemons)."""
        return self._tenants_file is not None

    def refresh_tenants(self) -> dict[str, Tenant]:
        """The tenants, re-read if the file changed (a file that turned bad keeps the last good ones)."""
        return self._refresh().tenants

    def _refresh(self) -> Access:
        if self._tenants_file is None:
            return self._access
        try:
            st = self._tenants_file.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp != self._tenants_stamp:
            if not self._loaded:
                self._access = load_access(self._tenants_file)  # at start: a bad file is an error
                self._loaded = True
                self.loads += 1
            else:
                try:
                    self._access = load_access(self._tenants_file)
                    self.file_error = ""
                    self.loads += 1
                except ConfigError as exc:  # the last good tenants serve meanwhile, the error in view
                    self.file_errors += 1
                    self.file_error = str(exc)
                    log.error("%s; keeping the %d tenants read before", exc, len(self._access.tenants))
            self._tenants_stamp = stamp
        return self._access

    def current(self, identity: Identity) -> Identity | None:
        """A tenant's logged-in ``identity`` as things stand now: its operations as they are now, or
        None when the tenant is gone or the token it logged in with was replaced (its session is
        over). On the master, as the tenants file read last says (reads no file:
        :meth:`refresh_tenants` does, on the server's tick); on a daemon, as the master's last
        :class:`TenantsPolicy` says (a ticket's operations only narrow; before any policy came,
        the ticket alone)."""
        if identity.tenant is None:
            return identity
        if self.takes_tokens:
            tenant = self._access.tenants.get(identity.tenant)
            if tenant is None or tenant.key_for(identity.key_id) is None:
                return None
            operations = tenant.operations
        elif self._policy is None:
            return identity
        else:
            entry = self._policy.get(identity.tenant)
            key, issued = identity.key_id[:8], int.from_bytes(identity.key_id[8:16], "big")
            if entry is None or key not in entry[1]:
                # Issued after the master's last word: it knew of this tenant (or key) then.
                return identity if issued > self._policy_as_of else None
            operations = identity.operations & entry[0]
        if operations != identity.operations:
            return Identity(identity.name, identity.tenant, operations, identity.key_id)
        return identity

    def tenant(self, name: str) -> Tenant | None:
        return self.refresh_tenants().get(name)

    def bearer(self, token: str) -> Admin | Tenant | None:
        """Whose admin API bearer token ``token`` is: an admin's, a tenant's, or nobody's
        (constant-time comparison of the stored keys)."""
        try:
            name, _ = _split_token(token)
        except ConfigError:
            return None
        key = stored_key(token)
        access = self._refresh()
        tenant_key = verifier(token)
        found: Admin | Tenant | None = None
        admin, tenant = access.admins.get(name), access.tenants.get(name)
        if admin is not None and hmac.compare_digest(admin.stored_key, key):
            found = admin
        if tenant is not None and (tenant.key_for(tenant_key) is not None or tenant.key_for(key) is not None):
            found = tenant
        return found

    # tickets
    def issue_ticket(self, identity: Identity, connection_key: bytes, now_ms: int | None = None) -> TicketReply:
        """A ticket for a tenant's connection: its name, its operations and when it ends, signed."""
        assert identity.tenant is not None
        issued = int(time.time() * 1000) if now_ms is None else now_ms
        expires = issued + self.ticket_ttl_ms
        ops = ",".join(sorted(identity.operations)).encode()
        key = key_fingerprint(identity.key_id).hex().encode()
        body = b"\0".join([identity.tenant.encode(), str(expires).encode(), ops, key, str(issued).encode(),
                            secrets.token_bytes(12).hex().encode()])  # fmt: skip
        ticket = body + _mac(self._ticket_key, b"ticket", body)
        session = _mac(self._ticket_key, b"session", ticket)
        sealed = _xor(session, _mac(connection_key, b"ticket", ticket))
        return TicketReply(ticket, sealed, expires)

    # seals of reservations
    def seal(self, tenant: str, node_id: str, key: str, offset: int, size: int, expires_ms: int) -> bytes:
        """The master's word that ``tenant`` may write ``key`` (its full name) at ``offset`` (``size``
        bytes) on ``node_id`` until ``expires_ms``: its end, then an HMAC under the ticket key."""
        end = expires_ms.to_bytes(8, "big")
        return end + _mac(self._ticket_key, b"extent", tenant.encode(), node_id.encode(), key.encode(),
                          str(offset).encode(), str(size).encode(), end)[:_SEAL_MAC]  # fmt: skip

    def check_seals(
        self, tenant: str, node_id: str, keys: list[str], offsets: list[int], sizes: list[int], seals: list[bytes],
        now_ms: int | None = None,
    ) -> None:  # fmt: skip
        """Raise PermissionDenied unless each write of ``tenant`` shows the master's unexpired seal of
        its extent on this node (a tenant writes only where the master reserved for it)."""
        if not len(keys) == len(offsets) == len(sizes):
            raise InvalidArgument(f"a malformed write: {len(keys)} keys, {len(offsets)} offsets, {len(sizes)} sizes")
        if len(seals) != len(keys):
            raise PermissionDenied(
                f"tenant {tenant!r} writes only into extents the master reserved for it: {len(keys)} blocks,"
                f" {len(seals)} seals"
            )
        now = int(time.time() * 1000) if now_ms is None else now_ms
        for key, offset, size, seal in zip(keys, offsets, sizes, seals, strict=True):
            expires = int.from_bytes(seal[:8], "big")
            expected = self.seal(tenant, node_id, key, offset, size, expires)
            if len(seal) != len(expected) or not hmac.compare_digest(seal, expected):
                raise PermissionDenied(f"no reservation of the master for {key!r} at offset {offset} on {node_id}")
            if expires + TICKET_SKEW_MS < now:
                raise PermissionDenied(f"the reservation for {key!r} at offset {offset} has expired")

    def _open_ticket(self, name: str, ticket: bytes) -> tuple[Identity, bytes]:
        """The identity a genuine, unexpired ticket of tenant ``name`` vouches for, and its session key."""
        body, mac = ticket[:-32], ticket[-32:]
        if len(ticket) <= 32 or not hmac.compare_digest(mac, _mac(self._ticket_key, b"ticket", body)):
            raise AuthFailed("the ticket is not one this cluster's master issued")
        parts = body.split(b"\0")
        if len(parts) != 6 or parts[0] != name.encode():
            raise AuthFailed("the ticket is not this tenant's")
        if int(parts[1]) + TICKET_SKEW_MS < time.time() * 1000:
            raise AuthFailed(f"the ticket of tenant {name!r} has expired; the client asks the master for a new one")
        operations = frozenset(parts[2].decode().split(",")) - {""}
        key_id = bytes.fromhex(parts[3].decode()) + int(parts[4]).to_bytes(8, "big")  # its key, when it was issued
        identity = self.current(Identity(name, name, operations, key_id))
        if identity is None:
            raise AuthFailed(f"tenant {name!r} was removed or its token replaced since this ticket was issued")
        return identity, _mac(self._ticket_key, b"session", ticket)

    # what the master tells daemons of its tenants
    def max_sessions(self, tenant: str) -> int:
        """The sessions ``tenant`` may have open at once here: its own cap (the tenants file on a
        master, the master's word on a daemon), else :attr:`default_max_sessions`."""
        if self._tenants_file is None:
            return self._session_caps.get(tenant) or self.default_max_sessions
        known = self._refresh().tenants.get(tenant)
        return (known.max_sessions if known is not None else 0) or self.default_max_sessions

    def max_inflight(self, tenant: str) -> int:
        """The bytes of frames ``tenant`` may have begun sending and not finished here, over all its
        sessions (as :meth:`max_sessions`: its own cap, else :attr:`default_max_inflight`)."""
        if self._tenants_file is None:
            return self._inflight_caps.get(tenant) or self.default_max_inflight
        known = self._refresh().tenants.get(tenant)
        return (known.max_inflight_bytes if known is not None else 0) or self.default_max_inflight

    def policy(self, now_ms: int | None = None) -> TenantsPolicy:
        """The tenants file as daemons need it (a master's): names, operations, fingerprints of the keys taken."""
        tenants = sorted(self._refresh().tenants.values(), key=lambda t: t.name)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return TenantsPolicy([t.name for t in tenants], [sorted(t.operations) for t in tenants],
                             [t.fingerprints(now) for t in tenants], now,
                             [t.max_sessions or self.default_max_sessions for t in tenants],
                             [t.max_inflight_bytes or self.default_max_inflight for t in tenants])  # fmt: skip

    def take_policy(self, policy: TenantsPolicy) -> None:
        """A daemon's: the master's word on which tenants' tickets to take, and what they may do."""
        if not len(policy.names) == len(policy.operations) == len(policy.keys):
            raise InvalidArgument("a TenantsPolicy whose lists differ in length")
        self._policy = {
            name: (frozenset(ops), frozenset(keys))
            for name, ops, keys in zip(policy.names, policy.operations, policy.keys, strict=True)
        }
        self._policy_as_of = policy.as_of_ms
        if len(policy.max_sessions) == len(policy.names):
            self._session_caps = dict(zip(policy.names, policy.max_sessions, strict=True))
        if len(policy.max_inflight) == len(policy.names):
            self._inflight_caps = dict(zip(policy.names, policy.max_inflight, strict=True))


def _proves(key: bytes, proof: AuthProof, transcript: bytes) -> bool:
    """Whether ``proof`` shows the token of the verifier ``key``: its Ed25519 signature of the
    transcript, or for a legacy verifier the SCRAM-style proof of its client key."""
    if not is_legacy(key):
        try:
            Ed25519PublicKey.from_public_bytes(key[len(ED25519) :]).verify(proof.signature, transcript)
        except (InvalidSignature, ValueError):
            return False
        return True
    recovered = _xor(proof.proof, _mac(key, b"client", transcript)) if len(proof.proof) == 32 else b""
    return hmac.compare_digest(legacy_verifier_of(recovered), key)


def as_refusal(exc: KVStoreError) -> AuthFailed:
    """What a server answers a handshake that failed with ``exc`` (a wrong proof, a frame that is
    not the handshake's): an AuthFailed naming why."""
    return exc if isinstance(exc, AuthFailed) else AuthFailed(str(exc))


class ServerHandshake:
    """One server connection's handshake: :meth:`challenge` an AuthHello, then :meth:`verify` the
    proof; AuthFailed (naming why) at any step means the connection must close."""

    def __init__(self, authority: Authority) -> None:
        self.authority = authority
        self._hello: AuthHello | None = None
        self._nonce = b""
        self._challenge = AuthChallenge(b"")
        self._ephemeral: X25519PrivateKey | None = None

    @property
    def expects_proof(self) -> bool:
        """Whether a challenge was sent and its proof is the next frame."""
        return self._hello is not None

    def challenge(self, hello: Message) -> AuthChallenge:
        if not isinstance(hello, AuthHello):
            raise AuthFailed(
                f"authentication required before {type(hello).__name__}: connect with a tenant token"
                " (ClientConfig(token=...) or KVSTORE_TOKEN) or the cluster secret"
            )
        if len(hello.nonce) != _NONCE_BYTES or len(hello.name) > _MAX_NAME or len(hello.ticket) > _MAX_TICKET:
            raise AuthFailed("a malformed AuthHello")
        if self._nonce:
            raise AuthFailed("one AuthHello per connection")
        self._hello = hello
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        if hello.kind != "tenant":
            self._challenge = AuthChallenge(self._nonce)
            return self._challenge
        if len(hello.ephemeral) != 32:
            raise AuthFailed("a tenant's AuthHello carries no ephemeral key: a client of an older version")
        tenant = self.authority.tenant(hello.name) if self.authority.takes_tokens else None
        legacy = tenant is not None and any(is_legacy(k) for k in tenant.taken())
        self._ephemeral = X25519PrivateKey.generate()
        public = self._ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._challenge = AuthChallenge(self._nonce, public, legacy)
        return self._challenge

    def verify(self, proof: Message) -> tuple[Identity, AuthOk, bytes]:
        """The peer's identity, the AuthOk to send, and the connection's key."""
        hello = self._hello
        if hello is None or not isinstance(proof, AuthProof):
            raise AuthFailed(f"expected the handshake's proof, got {type(proof).__name__}")
        self._hello = None  # one proof per challenge
        transcript = _transcript(hello, self._challenge)
        identity: Identity
        if hello.kind == "cluster":
            key = self.authority.cluster_key
            if not hmac.compare_digest(proof.proof, _mac(key, b"client", transcript)):
                raise AuthFailed("wrong cluster secret")
            identity = CLUSTER
        elif hello.kind == "tenant":
            if not self.authority.takes_tokens:
                raise AuthFailed("a daemon takes tenants' tickets, not their tokens (the client asks the master)")
            tenant = self.authority.tenant(hello.name)
            matched = next((k for k in tenant.taken() if _proves(k, proof, transcript)), None) if tenant else None
            if tenant is None or matched is None:
                raise AuthFailed(f"unknown tenant or wrong token for {hello.name!r}")
            assert self._ephemeral is not None
            key = _session(_shared(self._ephemeral, hello.ephemeral), matched, transcript)
            identity = Identity(tenant.name, tenant.name, tenant.operations, matched)
        else:
            if self.authority.takes_tokens:
                raise AuthFailed("the master takes tenants' tokens, not tickets (tickets are for daemons)")
            if not TENANT_NAME.match(hello.name):
                raise AuthFailed("a ticket names no tenant")
            identity, key = self.authority._open_ticket(hello.name, hello.ticket)
            if not hmac.compare_digest(proof.proof, _mac(key, b"client", transcript)):
                raise AuthFailed(f"wrong proof for the ticket of tenant {hello.name!r}")
        return identity, AuthOk(_mac(key, b"server", transcript)), _mac(key, b"connection", transcript)

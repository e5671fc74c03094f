"""Who is at the other end of a connection: credentials, the handshake's proofs, tenants and tickets.

Pure: fed messages, knows no socket (:mod:`transfer.auth` runs the handshake over
connections). Three kinds of credential:

- the **cluster secret**, shared by the master, the daemons and operators' tools: identity
  ``cluster``, allowed everything, keys unscoped;
- a **tenant token** ``NAME.SECRET``, a client of tenant NAME. The master keeps only the
  stored key ``sha256(client_key)``, where ``client_key = HMAC(token, "kvstore client key")``;
  the client proves it knows ``client_key`` as SCRAM does (``client_key XOR
  HMAC(stored_key, transcript)``), so a stolen tenants file logs nobody in;
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

The server's fresh nonce makes a replayed proof worthless; the server's proof lets the client
refuse an impostor; checks are constant-time (:func:`hmac.compare_digest`). The handshake
authenticates the peers, not each later frame: on an untrusted network, TLS keeps the stream
itself from being read or hijacked.

A tenant's keys live in its namespace ``NAME/``: the servers put that prefix in front of every
key a tenant's connection names (:meth:`Identity.scope`), so that it cannot name another's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvstore.errors import AuthFailed, ConfigError, InvalidArgument, InvalidKey, KVStoreError, PermissionDenied
from kvstore.keys import MAX_KEY_BYTES
from kvstore.protocol import (
    AdminInfo,
    AuthChallenge,
    AuthHello,
    AuthOk,
    AuthProof,
    CommitBlocks,
    Exists,
    GetReplicas,
    GetTicket,
    GrantSpace,
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
    ReturnGrants,
    Stats,
    TicketReply,
    WriteBlocks,
    WriteGranted,
    WriteSlices,
)

log = logging.getLogger("kvstore.auth")

Operation = Literal["read", "write", "remove"]
OPERATIONS: tuple[Operation, ...] = ("read", "write", "remove")

_OPERATION_OF: dict[type[Message], Operation] = {
    GetReplicas: "read", ReleaseLeases: "read", MatchPrefix: "read", MatchPrefixNodes: "read", Exists: "read",
    Stats: "read", ListNodes: "read", AdminInfo: "read", GetTicket: "read", ReadBlocks: "read",
    ReadSlices: "read", ListKeys: "read",
    PutStart: "write", PutEnd: "write", PutRevoke: "write", GrantSpace: "write", ReturnGrants: "write",
    Replicate: "write", WriteBlocks: "write", WriteGranted: "write", WriteSlices: "write", CommitBlocks: "write",
    Remove: "remove",
}  # fmt: skip
"""What a tenant may be allowed, per request; a request not listed is the cluster's alone (a node
registering, the master's commands to daemons, a daemon's reports)."""


TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
"""A tenant's name: also the first part of its token and of its keys (``NAME/``)."""

_RESERVED = frozenset({"cluster", "anyone"})
"""Names of the identities that are not tenants."""

MIN_SECRET_BYTES = 16
TICKET_SKEW_MS = 60_000
"""Clocks of the master and the daemons may differ by this much: a ticket is taken this long past its end."""

_NONCE_BYTES = 16
_SEAL_MAC = 16
_MAX_NAME = 64
_MAX_TICKET = 256
_TRANSCRIPT_TAG = b"kvstore-auth-1"


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


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


def _split_token(token: str) -> tuple[str, bytes]:
    name, sep, rest = token.partition(".")
    if not sep or not TENANT_NAME.match(name) or len(rest) < MIN_SECRET_BYTES:
        raise ConfigError("a tenant token is NAME.SECRET, as `kvstore tenants add` prints it; this one is not")
    return name, token.encode()


def client_key(token: str) -> bytes:
    return _mac(_split_token(token)[1], b"kvstore client key")


def stored_key(token: str) -> bytes:
    """What the tenants file keeps of a token (it cannot be turned back into one)."""
    return hashlib.sha256(client_key(token)).digest()


def tenant_credential(token: str) -> Credential:
    name, _ = _split_token(token)
    return Credential("tenant", name, client_key(token))


def check_tenant_name(name: str, where: str = "") -> None:
    """Raise ConfigError unless ``name`` can name a tenant (``where``: the file it came from)."""
    at = f"{where}: " if where else ""
    if name in _RESERVED:
        raise ConfigError(f"{at}{name!r} names the cluster's own identity, not a tenant")
    if not TENANT_NAME.match(name):
        raise ConfigError(
            f"{at}tenant name {name!r}: 1-64 letters, digits, '_' or '-', starting with a letter or digit"
        )


def new_token(name: str) -> str:
    check_tenant_name(name)
    return f"{name}.{secrets.token_urlsafe(32)}"


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


def _transcript(hello: AuthHello, server_nonce: bytes) -> bytes:
    return b"\0".join([_TRANSCRIPT_TAG, hello.kind.encode(), hello.name.encode(), hello.nonce, server_nonce,
                       hello.ticket])  # fmt: skip


class ClientHandshake:
    """One client connection's handshake: :meth:`hello`, then :meth:`proof` of the server's
    challenge, then :meth:`finish` with its AuthOk, which yields the connection's own key."""

    def __init__(self, credential: Credential) -> None:
        self.credential = credential
        self._hello = AuthHello(credential.kind, credential.name, secrets.token_bytes(_NONCE_BYTES), credential.ticket)
        self._transcript = b""

    def hello(self) -> AuthHello:
        return self._hello

    def proof(self, challenge: Message) -> AuthProof:
        if not isinstance(challenge, AuthChallenge) or len(challenge.nonce) != _NONCE_BYTES:
            raise AuthFailed(f"the server answered the handshake with {type(challenge).__name__}, not a challenge")
        self._transcript = _transcript(self._hello, challenge.nonce)
        c = self.credential
        if c.kind == "tenant":
            stored = hashlib.sha256(c.key).digest()
            return AuthProof(_xor(c.key, _mac(stored, b"client", self._transcript)))
        return AuthProof(_mac(c.key, b"client", self._transcript))

    def finish(self, ok: Message) -> bytes:
        """Check the server's proof; the key only this connection's two ends know."""
        if not isinstance(ok, AuthOk):
            raise AuthFailed(f"the server answered the proof with {type(ok).__name__}")
        key = _server_side_key(self.credential)
        if not hmac.compare_digest(ok.proof, _mac(key, b"server", self._transcript)):
            raise AuthFailed("the server could not prove it knows this credential: not the server it claims to be")
        return _mac(key, b"connection", self._transcript)


def _server_side_key(c: Credential) -> bytes:
    """The key both ends hold: the tenant's stored key, else the credential's own."""
    return hashlib.sha256(c.key).digest() if c.kind == "tenant" else c.key


def open_ticket(reply: TicketReply, connection_key: bytes, tenant: str) -> Credential:
    """The ticket credential in a master's TicketReply (its session key unmasked)."""
    if len(reply.sealed_key) != 32:
        raise AuthFailed("the master's ticket reply carries no session key")
    mask = _mac(connection_key, b"ticket", reply.ticket)
    return Credential("ticket", tenant, _xor(reply.sealed_key, mask), reply.ticket, reply.expires_ms)


# -- tenants (the master's file) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    name: str
    stored_key: bytes = field(repr=False)
    quota_bytes: int = 0
    """Bytes of blocks the tenant may hold, DRAM and SSD together; 0: no quota."""
    operations: frozenset[str] = frozenset(OPERATIONS)


ADMIN_ROLES = ("read-only", "operator")
"""Roles of the admin API's tokens: read-only may GET every route; operator may also evict and drain."""


@dataclass(frozen=True)
class Admin:
    """A token of the master's admin API (kept in the tenants file, table ``admins``)."""

    name: str
    stored_key: bytes = field(repr=False)
    role: str = "read-only"


@dataclass(frozen=True)
class Access:
    """What a tenants file says: the tenants (RPC and admin API, each in its namespace) and the
    admin API's own tokens."""

    tenants: dict[str, Tenant]
    admins: dict[str, Admin]


def _stored_key_of(name: str, entry: dict[str, Any], what: str) -> bytes:
    try:
        key = bytes.fromhex(str(entry["token_sha256"]))
    except (KeyError, ValueError):
        raise ConfigError(f"{what} {name!r} needs token_sha256, 64 hex digits") from None
    if len(key) != 32:
        raise ConfigError(f"{what} {name!r}: token_sha256 must be 64 hex digits")
    return key


def _entry(name: str, entry: Any, where: str, kind: str, settings: set[str]) -> dict[str, Any]:
    check_tenant_name(name, where)
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: {kind} {name!r} must be a table")
    unknown = set(entry) - settings
    if unknown:
        raise ConfigError(f"{where}: {kind} {name!r} has unknown settings {sorted(unknown)}")
    return entry


def _tenant_from(name: str, entry: Any, where: str) -> Tenant:
    entry = _entry(name, entry, where, "tenant", {"token_sha256", "quota_bytes", "operations"})
    key = _stored_key_of(name, entry, f"{where}: tenant")
    quota = entry.get("quota_bytes", 0)
    if type(quota) is not int or quota < 0:
        raise ConfigError(f"{where}: tenant {name!r}: quota_bytes must be a non-negative integer")
    ops = entry.get("operations", list(OPERATIONS))
    if not isinstance(ops, list) or not set(ops) <= set(OPERATIONS):
        raise ConfigError(f"{where}: tenant {name!r}: operations must be a list of {list(OPERATIONS)}")
    return Tenant(name, key, quota, frozenset(ops))


def _admin_from(name: str, entry: Any, where: str) -> Admin:
    entry = _entry(name, entry, where, "admin", {"token_sha256", "role"})
    key = _stored_key_of(name, entry, f"{where}: admin")
    role = entry.get("role", "read-only")
    if role not in ADMIN_ROLES:
        raise ConfigError(f"{where}: admin {name!r}: role must be one of {list(ADMIN_ROLES)}, not {role!r}")
    return Admin(name, key, role)


def _read_access_data(p: Path) -> dict[str, Any]:
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"tenants file {p}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"tenants file {p}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"tenants file {p}: expected tables 'tenants' and 'admins'")
    return data


def load_access(path: str | os.PathLike[str]) -> Access:
    """Tenants and admin tokens from a TOML or JSON file: a table ``tenants`` of NAME ->
    {token_sha256, quota_bytes, operations} and a table ``admins`` of NAME -> {token_sha256, role}.
    ConfigError names the file and what is wrong."""
    p = Path(path)
    data = _read_access_data(p)
    where = f"tenants file {p}"
    tables = {}
    for table in ("tenants", "admins"):
        tables[table] = data.get(table, {})
        if not isinstance(tables[table], dict):
            raise ConfigError(f"{where}: '{table}' must be a table")
    unknown = set(data) - set(tables)
    if unknown:
        raise ConfigError(f"{where}: unknown tables {sorted(unknown)} (there are 'tenants' and 'admins')")
    return Access(
        {name: _tenant_from(name, entry, where) for name, entry in tables["tenants"].items()},
        {name: _admin_from(name, entry, where) for name, entry in tables["admins"].items()},
    )


def _add_entry(path: str | os.PathLike[str], table: str, name: str, entry: dict[str, Any]) -> str:
    """Add ``entry`` with a new token to ``table`` of the file (created if absent) and return the
    token (shown once). The file is replaced atomically, so a master reading it never sees half of it."""
    token = new_token(name)
    p = Path(path)
    data: dict[str, Any] = {}
    if p.exists() and p.read_text().strip():
        access = load_access(p)  # checks the file first
        if name in getattr(access, table):
            raise ConfigError(f"tenants file {p}: {table[:-1]} {name!r} exists already")
        data = _read_access_data(p)
    data.setdefault(table, {})[name] = {"token_sha256": stored_key(token).hex(), **entry}
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n" if p.suffix == ".json" else _toml(data))
    os.chmod(tmp, 0o600)
    os.replace(tmp, p)
    return token


def add_tenant(path: str | os.PathLike[str], name: str, quota_bytes: int = 0,
               operations: tuple[str, ...] = OPERATIONS) -> str:  # fmt: skip
    """Add tenant ``name`` to the file and return its new token (shown once)."""
    if not set(operations) <= set(OPERATIONS):
        raise ConfigError(f"operations must be among {list(OPERATIONS)}")
    return _add_entry(path, "tenants", name, {"quota_bytes": quota_bytes, "operations": list(operations)})


def add_admin(path: str | os.PathLike[str], name: str, role: str = "read-only") -> str:
    """Add an admin API token of ``role`` to the file and return it (shown once)."""
    if role not in ADMIN_ROLES:
        raise ConfigError(f"an admin's role is one of {list(ADMIN_ROLES)}, not {role!r}")
    return _add_entry(path, "admins", name, {"role": role})


def _toml(data: dict[str, Any]) -> str:
    lines = []
    for table in ("tenants", "admins"):
        for name, entry in data.get(table, {}).items():
            lines.append(f"[{table}.{name}]")
            for setting, value in entry.items():
                lines.append(f"{setting} = {json.dumps(value)}")  # strings, ints and lists of strings: TOML too
            lines.append("")
    return "\n".join(lines)


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
            else:
                try:
                    self._access = load_access(self._tenants_file)
                except ConfigError as exc:  # the last good tenants serve meanwhile
                    log.error("%s; keeping the %d tenants read before", exc, len(self._access.tenants))
            self._tenants_stamp = stamp
        return self._access

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
        found: Admin | Tenant | None = None
        for entry in (access.admins.get(name), access.tenants.get(name)):
            if entry is not None and hmac.compare_digest(entry.stored_key, key):
                found = entry
        return found

    # tickets
    def issue_ticket(self, identity: Identity, connection_key: bytes, now_ms: int | None = None) -> TicketReply:
        """A ticket for a tenant's connection: its name, its operations and when it ends, signed."""
        assert identity.tenant is not None
        expires = (int(time.time() * 1000) if now_ms is None else now_ms) + self.ticket_ttl_ms
        ops = ",".join(sorted(identity.operations)).encode()
        body = b"\0".join(
            [identity.tenant.encode(), str(expires).encode(), ops, secrets.token_bytes(12).hex().encode()]
        )
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
        if len(parts) != 4 or parts[0] != name.encode():
            raise AuthFailed("the ticket is not this tenant's")
        if int(parts[1]) + TICKET_SKEW_MS < time.time() * 1000:
            raise AuthFailed(f"the ticket of tenant {name!r} has expired; the client asks the master for a new one")
        operations = frozenset(parts[2].decode().split(",")) - {""}
        return Identity(name, name, operations), _mac(self._ticket_key, b"session", ticket)


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
        return AuthChallenge(self._nonce)

    def verify(self, proof: Message) -> tuple[Identity, AuthOk, bytes]:
        """The peer's identity, the AuthOk to send, and the connection's key."""
        hello = self._hello
        if hello is None or not isinstance(proof, AuthProof):
            raise AuthFailed(f"expected the handshake's proof, got {type(proof).__name__}")
        self._hello = None  # one proof per challenge
        transcript = _transcript(hello, self._nonce)
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
            key = tenant.stored_key if tenant is not None else secrets.token_bytes(32)
            recovered = _xor(proof.proof, _mac(key, b"client", transcript)) if len(proof.proof) == 32 else b""
            if not hmac.compare_digest(hashlib.sha256(recovered).digest(), key) or tenant is None:
                raise AuthFailed(f"unknown tenant or wrong token for {hello.name!r}")
            identity = Identity(tenant.name, tenant.name, tenant.operations)
        else:
            if self.authority.takes_tokens:
                raise AuthFailed("the master takes tenants' tokens, not tickets (tickets are for daemons)")
            if not TENANT_NAME.match(hello.name):
                raise AuthFailed("a ticket names no tenant")
            identity, key = self.authority._open_ticket(hello.name, hello.ticket)
            if not hmac.compare_digest(proof.proof, _mac(key, b"client", transcript)):
                raise AuthFailed(f"wrong proof for the ticket of tenant {hello.name!r}")
        return identity, AuthOk(_mac(key, b"server", transcript)), _mac(key, b"connection", transcript)

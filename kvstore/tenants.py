"""Tenants and their tokens: what the master's tenants file says, and the verbs that change it.

A tenant token is ``NAME.SECRET``. The file keeps only each token's stored key,
``sha256(client_key)`` with ``client_key = HMAC(token, "kvstore client key")``, never a token; the
handshake (:mod:`kvstore.auth`) checks a client's proof against it. The file is TOML or JSON: a
table ``tenants`` of NAME -> {token_ed25519, quota_bytes, operations, and while a rotation's grace
lasts previous_token_ed25519 and previous_until_ms} and a table ``admins`` of NAME -> {token_sha256,
role}. A tenant's verifier is the public half of an Ed25519 key derived from its token: a client
proves its token by signing the handshake, so a stolen file lets nobody log in, with or without
recorded handshakes. Files written before keep ``token_sha256`` (legacy: a stolen file plus one
recorded handshake gives the token's client key away); they work on, flagged, until rotated.
Every change replaces the file atomically (a master reading it never sees half of it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvstore.errors import ConfigError

Operation = Literal["read", "write", "remove"]
OPERATIONS: tuple[Operation, ...] = ("read", "write", "remove")


TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
"""A tenant's name: also the first part of its token and of its keys (``NAME/``)."""

_RESERVED = frozenset({"cluster", "anyone"})
"""Names of the identities that are not tenants."""

MIN_SECRET_BYTES = 16


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def _split_token(token: str) -> tuple[str, bytes]:
    name, sep, rest = token.partition(".")
    if not sep or not TENANT_NAME.match(name) or len(rest) < MIN_SECRET_BYTES:
        raise ConfigError("a tenant token is NAME.SECRET, as `kvstore tenants add` prints it; this one is not")
    return name, token.encode()


def client_key(token: str) -> bytes:
    return _mac(_split_token(token)[1], b"kvstore client key")


def key_fingerprint(stored: bytes) -> bytes:
    """A short name of a stored key, which tickets carry and daemons are told (not the key: it
    cannot stand in for it)."""
    return hashlib.sha256(b"kvstore key fingerprint\0" + stored).digest()[:8]


ED25519 = b"ed25519:"
"""Prefix of a verifier that is an Ed25519 public key (the handshake then checks a signature)."""


def signing_seed(client: bytes) -> bytes:
    """The Ed25519 seed of a tenant's signing key, from its client key (the token's HMAC)."""
    return hmac.new(client, b"kvstore signing key", hashlib.sha256).digest()


def verifier(token: str) -> bytes:
    """What the tenants file keeps of a token: its signing key's public half (Ed25519), from which
    neither the token nor anything a handshake keys on can be derived."""
    return verifier_of(client_key(token))


def verifier_of(client: bytes) -> bytes:
    """:func:`verifier` of the token whose client key is ``client``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    private = Ed25519PrivateKey.from_private_bytes(signing_seed(client))
    return ED25519 + private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def is_legacy(key: bytes) -> bool:
    """Whether a stored verifier is a token's sha256 (files written before Ed25519 verifiers):
    a stolen file plus one recorded handshake gives that token's client key away. Rotate it."""
    return not key.startswith(ED25519)


def stored_key(token: str) -> bytes:
    """What the tenants file keeps of a token (it cannot be turned back into one)."""
    return legacy_verifier_of(client_key(token))


def legacy_verifier_of(client: bytes) -> bytes:
    """The sha256 verifier files written before Ed25519 keep of the token whose client key is ``client``."""
    return hashlib.sha256(client).digest()


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


# -- tenants (the master's file) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    name: str
    stored_key: bytes = field(repr=False)
    quota_bytes: int = 0
    """Bytes of blocks the tenant may hold, DRAM and SSD together; 0: no quota."""
    operations: frozenset[str] = frozenset(OPERATIONS)
    previous_key: bytes = field(default=b"", repr=False)
    """The stored key of the token a rotation replaced, taken until ``previous_until_ms``."""
    previous_until_ms: int = 0
    max_sessions: int = 0
    """Authenticated sessions the tenant may have open at once on the master, and as many on each
    daemon; 0: the cluster's default (``tenant_max_sessions``)."""
    max_objects: int = 0
    """Keys (stored or being written) the tenant may hold at once; 0: no cap beyond its quota's bytes
    (each key is charged at least an index slot's worth of them)."""
    max_pinned: int = 0
    """Pinned keys the tenant may hold at once (nothing evicts them); 0: no cap beyond its quota."""
    max_inflight_bytes: int = 0
    """Bytes of frames the tenant may have begun sending and not finished, over all its sessions, on
    the master and on each daemon; 0: the cluster's default (``tenant_max_inflight_bytes``)."""
    replicas: int = 0
    """Copies each of the tenant's puts gets at least, whatever its clients ask (reads of its keys
    then survive a node's failure); 0 or 1: as its clients ask. Puts into write grants (one copy)
    are not for such a tenant: its clients put the two-trip way."""

    def taken(self, now_ms: int | None = None) -> list[bytes]:
        """The verifiers a login may match now: the current one, and a rotated one during its grace."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return [self.stored_key] + ([self.previous_key] if self.previous_key and now < self.previous_until_ms else [])

    def fingerprints(self, now_ms: int | None = None) -> list[bytes]:
        """:func:`key_fingerprint` of each stored key still taken (the previous one while its grace lasts)."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        keys = [self.stored_key] + ([self.previous_key] if self.previous_key and now < self.previous_until_ms else [])
        return [key_fingerprint(k) for k in keys]

    def key_for(self, key: bytes, now_ms: int | None = None) -> bytes | None:
        """Which of this tenant's stored keys ``key`` is, if it is still taken: the current one, or
        the one a rotation replaced while its grace lasts; None otherwise (constant-time compares)."""
        current = hmac.compare_digest(self.stored_key, key)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        previous = bool(self.previous_key) and hmac.compare_digest(self.previous_key, key)
        if current:
            return self.stored_key
        return self.previous_key if previous and now < self.previous_until_ms else None


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


def _stored_key_of(name: str, entry: dict[str, Any], what: str, prefix: str = "") -> bytes:
    """The verifier in ``entry``: ``{prefix}token_ed25519`` (an Ed25519 public key), else the legacy
    ``{prefix}token_sha256``; each 64 hex digits."""
    field_name = f"{prefix}token_ed25519" if f"{prefix}token_ed25519" in entry else f"{prefix}token_sha256"
    try:
        key = bytes.fromhex(str(entry[field_name]))
    except (KeyError, ValueError):
        raise ConfigError(
            f"{what} {name!r} needs {prefix}token_ed25519 (or {prefix}token_sha256), 64 hex digits"
        ) from None
    if len(key) != 32:
        raise ConfigError(f"{what} {name!r}: {field_name} must be 64 hex digits")
    return ED25519 + key if field_name.endswith("ed25519") else key


def _key_fields(prefix: str, key: bytes) -> dict[str, str]:
    """A verifier as the file writes it."""
    if key.startswith(ED25519):
        return {f"{prefix}token_ed25519": key[len(ED25519) :].hex()}
    return {f"{prefix}token_sha256": key.hex()}


def _entry(name: str, entry: Any, where: str, kind: str, settings: set[str]) -> dict[str, Any]:
    check_tenant_name(name, where)
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: {kind} {name!r} must be a table")
    unknown = set(entry) - settings
    if unknown:
        raise ConfigError(f"{where}: {kind} {name!r} has unknown settings {sorted(unknown)}")
    return entry


CAPS = ("max_sessions", "max_objects", "max_pinned", "max_inflight_bytes")
"""A tenant's caps beside its quota, as the tenants file names them (0: the default)."""

MAX_REPLICAS = 16
"""The most copies a put may ask for (as ``PutOptions.replicas``)."""


def _tenant_from(name: str, entry: Any, where: str) -> Tenant:
    entry = _entry(name, entry, where, "tenant", {"token_ed25519", "token_sha256", "quota_bytes", "operations",
                                                   "previous_token_ed25519", "previous_token_sha256",
                                                   "previous_until_ms", "max_sessions", "max_objects",
                                                   "max_pinned", "max_inflight_bytes", "replicas"})  # fmt: skip
    key = _stored_key_of(name, entry, f"{where}: tenant")
    previous, until = b"", entry.get("previous_until_ms", 0)
    if "previous_token_ed25519" in entry or "previous_token_sha256" in entry:
        previous = _stored_key_of(name, entry, f"{where}: tenant", "previous_")
        if type(until) is not int or until < 0:
            raise ConfigError(f"{where}: tenant {name!r}: previous_until_ms must be a non-negative integer")
    quota = entry.get("quota_bytes", 0)
    if type(quota) is not int or quota < 0:
        raise ConfigError(f"{where}: tenant {name!r}: quota_bytes must be a non-negative integer")
    ops = entry.get("operations", list(OPERATIONS))
    if not isinstance(ops, list) or not set(ops) <= set(OPERATIONS):
        raise ConfigError(f"{where}: tenant {name!r}: operations must be a list of {list(OPERATIONS)}")
    caps = {}
    for cap in CAPS:
        caps[cap] = entry.get(cap, 0)
        if type(caps[cap]) is not int or caps[cap] < 0:
            raise ConfigError(f"{where}: tenant {name!r}: {cap} must be a non-negative integer")
    replicas = entry.get("replicas", 0)
    if type(replicas) is not int or not 0 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"{where}: tenant {name!r}: replicas must be an integer from 0 to {MAX_REPLICAS}")
    return Tenant(name, key, quota, frozenset(ops), previous, until if previous else 0, **caps, replicas=replicas)


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


def _write_access(p: Path, data: dict[str, Any]) -> None:
    """Replace the file with ``data`` atomically (a master reading it never sees half of it), 0600."""
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n" if p.suffix == ".json" else _toml(data))
    os.chmod(tmp, 0o600)
    os.replace(tmp, p)


def _edit(path: str | os.PathLike[str], table: str, name: str, create: bool = False) -> tuple[Path, dict[str, Any]]:
    """The file's data, checked, with ``name`` in ``table`` (or absent from it, with ``create``)."""
    p = Path(path)
    data: dict[str, Any] = {}
    if p.exists() and p.read_text().strip():
        load_access(p)  # checks the file first
        data = _read_access_data(p)
    known = name in data.get(table, {})
    if create and known:
        raise ConfigError(f"tenants file {p}: {table[:-1]} {name!r} exists already")
    if not create and not known:
        raise ConfigError(f"tenants file {p}: no {table[:-1]} {name!r}")
    return p, data


def _add_entry(path: str | os.PathLike[str], table: str, name: str, entry: dict[str, Any]) -> str:
    """Add ``entry`` with a new token to ``table`` of the file (created if absent) and return the
    token (shown once)."""
    token = new_token(name)
    p, data = _edit(path, table, name, create=True)
    key = verifier(token) if table == "tenants" else stored_key(token)  # admins' bearer tokens: over https only
    data.setdefault(table, {})[name] = {**_key_fields("", key), **entry}
    _write_access(p, data)
    return token


def remove_tenant(path: str | os.PathLike[str], name: str) -> None:
    """Take tenant ``name`` out of the file: a master ends its open sessions within a tick or two,
    and its daemons refuse its tickets once the master tells them (its keys stay until evicted or
    removed by an operator)."""
    p, data = _edit(path, "tenants", name)
    del data["tenants"][name]
    _write_access(p, data)


def set_tenant(path: str | os.PathLike[str], name: str, quota_bytes: int | None = None,
               operations: tuple[str, ...] | None = None, *, max_sessions: int | None = None,
               max_objects: int | None = None, max_pinned: int | None = None,
               max_inflight_bytes: int | None = None, replicas: int | None = None) -> None:  # fmt: skip
    """Change a tenant's quota, operations, caps (sessions, objects, pins, bytes in flight; 0: the
    default, no cap for objects and pins) or least replicas of its puts (:attr:`Tenant.replicas`);
    open sessions follow within a tick or two."""
    p, data = _edit(path, "tenants", name)
    entry = data["tenants"][name]
    if replicas is not None:
        if type(replicas) is not int or not 0 <= replicas <= MAX_REPLICAS:
            raise ConfigError(f"replicas is a number from 0 to {MAX_REPLICAS}, not {replicas!r}")
        entry["replicas"] = replicas
    given = (max_sessions, max_objects, max_pinned, max_inflight_bytes)
    for cap, value in zip(CAPS, given, strict=True):
        if value is not None:
            if type(value) is not int or value < 0:
                raise ConfigError(f"{cap} is a non-negative number, not {value!r}")
            entry[cap] = value
    if quota_bytes is not None:
        if type(quota_bytes) is not int or quota_bytes < 0:
            raise ConfigError(f"a quota is a non-negative number of bytes, not {quota_bytes!r}")
        entry["quota_bytes"] = quota_bytes
    if operations is not None:
        if not set(operations) <= set(OPERATIONS):
            raise ConfigError(f"operations must be among {list(OPERATIONS)}")
        entry["operations"] = list(operations)
    _write_access(p, data)


def rotate_tenant(path: str | os.PathLike[str], name: str, grace_s: float = 300.0) -> str:
    """A new token for tenant ``name`` (returned, shown once); the old one logs in for ``grace_s``
    more seconds, then is refused, and sessions opened with it end."""
    if grace_s < 0:
        raise ConfigError(f"a rotation's grace is a non-negative number of seconds, not {grace_s!r}")
    token = new_token(name)
    p, data = _edit(path, "tenants", name)
    entry = data["tenants"][name]
    old = _stored_key_of(name, entry, f"tenants file {p}: tenant")
    for stale in ("token_ed25519", "token_sha256", "previous_token_ed25519", "previous_token_sha256"):
        entry.pop(stale, None)
    entry.update(_key_fields("previous_", old))
    entry["previous_until_ms"] = int(time.time() * 1000 + grace_s * 1000)
    entry.update(_key_fields("", verifier(token)))
    _write_access(p, data)
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

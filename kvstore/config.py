"""Typed, frozen configuration models, one per component.

Sizes accept ints (bytes) or strings such as ``"256MiB"``, ``"4GiB"`` or
``"1.5GB"``. Unknown keys are errors. :func:`load` builds a model from keyword
overrides and ``KVSTORE_<COMPONENT>_<FIELD>`` environment variables (nested
fields joined by ``__``, e.g. ``KVSTORE_NODE_DRAM__CAPACITY=4GiB``); explicit
keyword arguments win over the environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from kvstore.errors import ConfigError, InvalidArgument

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Bytes in ``value``: an int, or a number with a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"size must be an int or a string such as '256MiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"size must not be negative, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is not None and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
        raise InvalidArgument(f"size {value!r} is not a number with a unit such as '256MiB' or '4GiB'")
    raise InvalidArgument(f"size must be an int or a string such as '256MiB', not {type(value).__name__}")


def format_size(num_bytes: float) -> str:
    """Human form of a byte count, in binary units (``"1.5 GiB"``)."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


ByteSize = Annotated[int, BeforeValidator(parse_size)]


Loc = tuple[int | str, ...]
"""Where a setting sits in a config: field names, outermost first (pydantic's ``loc``)."""


def _dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_REASONS = {"extra_forbidden": "unknown setting", "missing": "missing; this setting is required"}


def _config_error(subject: str, exc: ValidationError, name_of: Callable[[Loc], str]) -> ConfigError:
    """One :class:`ConfigError` naming every bad setting, the value given, and what is wrong with it."""
    problems = []
    for err in exc.errors():
        where = name_of(err["loc"]) if err["loc"] else ""
        # A whole section (a missing field, a cross-field rule) has no single value worth showing.
        if where and not isinstance(err["input"], Mapping | BaseModel):
            where += f"={_shown(err['input'])}"
        cause = err.get("ctx", {}).get("error")  # a validator's own exception, without pydantic's "Value error, "
        reason = str(cause) if isinstance(cause, Exception) else _REASONS.get(err["type"], err["msg"])
        problems.append(f"{where}: {reason}" if where else reason)
    return ConfigError(f"invalid {subject}: " + "; ".join(problems))


@contextmanager
def _config_errors(subject: str, name_of: Callable[[Loc], str] = _dotted) -> Iterator[None]:
    try:
        yield
    except ValidationError as exc:
        raise _config_error(subject, exc, name_of) from None


class _Frozen(BaseModel):
    """Base of every config model: frozen, unknown keys refused, defaults validated.

    Every way of building one (``Model(...)``, ``model_validate``, ``model_validate_json``,
    ``model_validate_strings``, :func:`load`) raises :class:`ConfigError` naming each bad setting
    and its value, never pydantic's ``ValidationError``. Validators inside the models may raise
    ``ValueError``: pydantic collects those with the rest and they come out here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def __init__(self, /, **data: Any) -> None:
        with _config_errors(type(self).__name__):
            super().__init__(**data)

    # Pydantic calls a model's own __init__ to validate it as a field of another model, which would
    # turn a nested error into an opaque one at the outer field. This __init__ only translates errors,
    # so pydantic may validate nested models as its own and keep the full path of a nested error.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        with _config_errors(cls.__name__):
            return super().model_validate(obj, *args, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, *args: Any, **kwargs: Any) -> Self:
        with _config_errors(cls.__name__):
            return super().model_validate_json(json_data, *args, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        with _config_errors(cls.__name__):
            return super().model_validate_strings(obj, *args, **kwargs)

    @classmethod
    def _validate_named(cls, obj: Mapping[str, Any], subject: str, name_of: Callable[[Loc], str]) -> Self:
        """``model_validate``, with settings named by ``name_of`` in the error (e.g. as environment variables)."""
        with _config_errors(subject, name_of):
            return super().model_validate(obj)


MIN_BLOCK_BYTES = 256
"""Blocks this large or larger never run out of DRAM index slots before the arena's bytes run out."""


class DramConfig(_Frozen):
    """The DRAM tier: an arena in a named shared-memory file."""

    capacity: ByteSize = Field(default=parse_size("256MiB"), gt=0, description="Bytes of block data the arena holds.")
    name: str = Field(
        default="node0",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Arena name; the file is <shm_dir>/kvstore-<name>.arena. Reusing a name re-attaches the arena.",
    )
    shm_dir: Path = Field(default=Path("/dev/shm"), description="Directory of the shared-memory file (a tmpfs).")
    alignment: int = Field(default=64, ge=8, description="Extent alignment in bytes; a power of two.")
    prefault: bool = Field(
        default=True,
        description="Touch every page of a new arena so that no write pays a page fault (its memory is reserved"
        " either way).",
    )
    max_blocks: int = Field(
        default=0,
        ge=0,
        description="Most blocks held at once (each an index record, made as blocks need them: 48 bytes for a key of"
        " up to 19 bytes, 16 more for each 15 bytes past that); 0 means one per 256 bytes of capacity (at least"
        " 1024), so that blocks of 256 bytes or more fill the bytes before the index.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")
        return self

    @property
    def max_slots(self) -> int:
        """The most index slots: blocks held at once."""
        return self.max_blocks or max(1024, self.capacity // MIN_BLOCK_BYTES)

    @property
    def num_slots(self) -> int:
        """Blocks a new arena's base index has room for (with keys of up to 34 bytes): one per 16 KiB
        of capacity (at least 1024, at most ``max_slots``); the index grows from there as blocks need it."""
        return min(self.max_slots, max(1024, self.capacity // (16 * 1024)))


class SsdConfig(_Frozen):
    """The SSD tier: an LMDB environment on local disk."""

    capacity: ByteSize = Field(default=0, ge=0, description="Bytes of block data; 0 (the default) disables the tier.")
    path: Path | None = Field(
        default=None, description="Directory of the LMDB environment; required when capacity > 0."
    )
    map_size: ByteSize = Field(
        default=0,
        ge=0,
        description="LMDB map size; 0 means 2 x capacity + 64 MiB, which covers page rounding of values.",
    )
    sync: bool = Field(
        default=False,
        description="fsync every commit. Off, a committed block survives a process crash but not a power loss.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.capacity > 0 and self.path is None:
            raise ValueError("ssd.path is required when ssd.capacity > 0")
        if self.map_size and self.map_size < self.capacity:
            raise ValueError(f"ssd.map_size ({self.map_size}) must be at least ssd.capacity ({self.capacity})")
        return self

    @property
    def effective_map_size(self) -> int:
        return self.map_size or 2 * self.capacity + 64 * 1024**2


class EvictionConfig(_Frozen):
    """When tiers evict and when SSD blocks come back to DRAM."""

    high_watermark: float = Field(default=0.99, gt=0, le=1, description="Evict when a put would fill a tier past this.")
    low_watermark: float = Field(default=0.97, gt=0, le=1, description="Evict down to this fraction of capacity.")
    promote_after_hits: int = Field(
        default=1, ge=0, description="Promote an SSD block to DRAM after this many reads; 0 never promotes."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must not exceed high_watermark ({self.high_watermark})"
            )
        return self


class NodeConfig(_Frozen):
    """One node's tiered store (DRAM arena + LMDB SSD tier)."""

    dram: DramConfig = Field(default_factory=DramConfig)
    ssd: SsdConfig = Field(default_factory=SsdConfig)
    eviction: EvictionConfig = Field(default_factory=EvictionConfig)
    verify_reads: bool = Field(default=False, description="Verify every block's checksum when it is read.")


ConfigT = TypeVar("ConfigT", bound=_Frozen)


def env_overrides(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Nested dict of the variables that start with ``prefix``; ``__`` separates nesting levels."""
    out: dict[str, Any] = {}
    for name, value in (os.environ if environ is None else environ).items():
        if not name.startswith(prefix) or name == prefix:
            continue
        path = name[len(prefix) :].lower().split("__")
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name} nests under a scalar setting {part!r}")
            node = child
        node[path[-1]] = value
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif isinstance(value, BaseModel) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value.model_dump(exclude_unset=True))
        else:
            out[key] = value
    return out


def load(model: type[ConfigT], component: str, environ: Mapping[str, str] | None = None, **overrides: Any) -> ConfigT:
    """Build ``model`` from ``KVSTORE_<COMPONENT>_*`` variables, then ``overrides``.

    Raises :class:`ConfigError` naming every unknown or malformed setting, as the
    environment variable or keyword path that set it, and its value.
    """
    prefix = f"KVSTORE_{component.upper()}_"
    merged = _merge(env_overrides(prefix, environ), overrides)
    return model._validate_named(merged, f"{component} config", lambda loc: _setting_name(loc, prefix, overrides))


def daemon_dram(environ: Mapping[str, str] | None = None, **overrides: Any) -> DramConfig:
    """The DRAM tier's config as a daemon reads it (``KVSTORE_DAEMON_DRAM__*``, then ``overrides``):
    where its arena lives, for tools that find or remove arenas."""
    return load(DramConfig, "daemon_dram_", environ, **overrides)


def _setting_name(loc: Loc, prefix: str, overrides: Mapping[str, Any]) -> str:
    """The name a user wrote: the environment variable, or the dotted keyword path."""
    if loc and loc[0] not in overrides:
        return prefix + "__".join(str(p) for p in loc).upper()
    return _dotted(loc) or "config"


class TlsConfig(_Frozen):
    """TLS (the standard library's ``ssl``) for a process's connections.

    The control plane (clients and daemons to the master; the admin API) is encrypted whenever a
    process has a TlsConfig; the data plane (daemons' ports: clients' reads and writes, the
    master's commands to daemons, fetches between daemons) only with ``data_plane``, which every
    process of the cluster must then set alike. Same-host shared memory and UCX are not TLS.
    """

    cert_file: str | None = Field(
        default=None,
        description="This process's certificate chain (PEM). Servers (the master; daemons with data_plane) must"
        " have one; a client shows it when the server verifies clients.",
    )
    key_file: str | None = Field(default=None, description="The private key of cert_file (PEM).")
    ca_file: str | None = Field(
        default=None,
        description="CA certificates (PEM) to verify peers with: the servers a client connects to, and clients when"
        " verify_clients is set; None: the system's CAs.",
    )
    verify_clients: bool = Field(
        default=False, description="Servers ask every client for a certificate signed by ca_file and refuse others."
    )
    data_plane: bool = Field(
        default=False,
        description="Also encrypt the daemons' ports (else they stay plain, for trusted fabrics: authentication"
        " still runs on them when the cluster has a secret).",
    )

    @model_validator(mode="after")
    def _pair(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if self.verify_clients and self.ca_file is None:
            raise ValueError("verify_clients needs ca_file: the CA that signs the clients' certificates")
        return self


MIN_HEARTBEAT_MS = 50
"""A daemon heartbeats every ``heartbeat_interval_ms``, but not more often than this."""


class MasterConfig(_Frozen):
    """The master: placement, eviction decisions, leases and membership."""

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=50051, ge=0, le=65535, description="RPC port; 0 picks a free one.")
    placement: str = Field(default="local_first", description="local_first, free_ratio or random.")
    eviction: EvictionConfig = Field(default_factory=EvictionConfig)
    reservation_ms: int = Field(default=30_000, gt=0, description="An uncommitted put is revoked after this.")
    lease_ms: int = Field(
        default=2_000, gt=0, description="Longest a get's replicas stay unevictable; clients release them sooner."
    )
    kv_lease_ms: int = Field(
        default=0,
        ge=0,
        description="Mooncake's KV lease (--default-kv-lease-ttl): a key found by a get or an exists is neither"
        " evicted nor removed without force for this long; 0: off.",
    )
    heartbeat_interval_ms: int = Field(
        default=50, gt=0, description="How often daemons heartbeat (not more often than every 50 ms)."
    )
    key_lease_ms: int | None = Field(
        default=None, ge=0,
        description="A daemon serves reads by key alone (a client's remembered location, no master asked) within "
        "a lease of 0.9x this less 20 ms from its last heartbeat the master answered with a renewal; the master "
        "renews none while the node owes it drops past that lease. So a remove (and a put of a key being removed) "
        "waits for a frozen or cut-off node at most this long, not the node TTL. Default: three heartbeats (150 ms), "
        "at most the node TTL; 0: reads by key follow the node TTL's lease alone.",
    )  # fmt: skip
    node_ttl_ms: int = Field(
        default=1_000, gt=0,
        description="A node silent this long is fenced: its daemon stopped serving (a lease of 0.9x this less "
        "20 ms from its last answered heartbeat), so the master counts its drops done (a remove waits no longer) "
        "and it comes back by registering again. A few heartbeats long.",
    )  # fmt: skip
    fence_refused: bool = Field(
        default=True,
        description="Fence a node at once, not after node_ttl_ms, when its daemon's port refuses the master's "
        "connection (the process is gone: a killed or crashed daemon). The master asks when a client reports the "
        "node unreachable, when a command to it fails, and when it missed two heartbeats. Likewise an HA standby "
        "whose leader's port refuses revokes the leader's etcd lease and is elected at once. Turn off where "
        "something between the processes answers refusals for a live one while others still reach it: a firewall "
        "that REJECTs, a proxy or load balancer at a daemon's or a master's advertised address (a Kubernetes "
        "Service with no ready endpoint).",
    )  # fmt: skip
    command_timeout_ms: int = Field(default=10_000, gt=0, description="Bound on one command to a daemon.")
    idle_timeout_s: float = Field(default=600.0, gt=0, description="An idle client connection is closed after this.")
    tenant_max_sessions: int = Field(
        default=512, ge=1, le=65536,
        description="Authenticated sessions one tenant may have open at once on the master, and on each daemon, "
        "unless its entry in the tenants file says otherwise (max_sessions).",
    )  # fmt: skip
    tenant_max_inflight_bytes: int = Field(
        default=256 << 20, ge=1 << 20,
        description="Bytes of frames one tenant may have begun sending and not finished, over all its sessions, on "
        "the master and on each daemon (a connection that takes it past this is closed), unless its entry in the "
        "tenants file says otherwise (max_inflight_bytes).",
    )  # fmt: skip
    tenant_idle_timeout_s: float = Field(
        default=60.0, gt=0, description="An idle tenant's session is closed after this (its client connects again)."
    )
    frame_timeout_s: float = Field(
        default=10.0, gt=0, le=600,
        description="A frame begun must arrive whole within this, however slowly its bytes trickle: its buffer is "
        "freed and the connection closed otherwise.",
    )  # fmt: skip
    max_connections: int = Field(
        default=4096, ge=1, description="Client and daemon connections served at once; more are closed at accept."
    )
    tick_ms: int = Field(default=100, gt=0, description="Period of expiry and command retries.")
    answer_ttl_s: float = Field(
        default=30.0, gt=0,
        description="How long the reply to a put, remove or grant is kept for a client's retry of it (a client"
        " retries within its own timeout, 10 s by default).",
    )  # fmt: skip
    answer_cache: int = Field(
        default=65_536, gt=0,
        description="Most replies kept for retries (a few hundred bytes each): bounds the master's memory under"
        " any request rate. 65,536 keep the 10 s in which a client may retry at 6,500 puts and removes a second"
        " (kvstore_master_answers_dropped_young_total counts replies dropped sooner).",
    )  # fmt: skip
    grant_ttl_ms: int = Field(
        default=10_000, gt=0, description="Granted write space (one-trip puts) returns to the pool after this."
    )
    eviction_log: int = Field(
        default=65_536, ge=0,
        description="Evictions the master keeps for GET /api/v1/evictions (key, node, why, when; 0: none).",
    )  # fmt: skip
    admin_header_timeout_s: float = Field(
        default=10.0, gt=0, le=600, description="An admin API request's head must arrive within this of its connection."
    )
    admin_body_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="An admin API request's body must arrive within this of its head."
    )
    admin_max_connections: int = Field(
        default=256, ge=1, le=65536, description="Admin API connections open at once (more are answered 503)."
    )
    tenant_max_grants: int = Field(
        default=16, ge=1, le=4096,
        description="Grants a tenant may have open at once (each reserves space its quota counts).",
    )  # fmt: skip
    grant_fraction: float = Field(
        default=1 / 64, gt=0, le=0.5, description="Largest grant, as a fraction of a node's DRAM."
    )
    kv_events: str | None = Field(
        default=None,
        description="ZMQ endpoint to publish KV events on (tcp://*:5557; a port of * or 0: any): each replica "
        "stored or dropped, in vLLM's format with Mooncake's medium and backend_id (see kvstore.events).",
    )  # fmt: skip
    kv_events_replay: str | None = Field(
        default=None, description="ZMQ endpoint (ROUTER) where subscribers that fell behind replay KV events."
    )
    kv_events_buffer: int = Field(
        default=10_000, ge=1, description="KV event batches kept for replay (each up to 1024 events)."
    )
    kv_events_buffer_bytes: int = Field(
        default=32 << 20, ge=1 << 16, description="Bytes of KV event batches kept for replay, at most (~150 an event)."
    )
    kv_events_topic: str = Field(default="", description="The topic frame of each KV events message.")
    admin_port: int | None = Field(
        default=None, ge=0, le=65535, description="Port of the REST admin API, /metrics and the dashboard (0: any)."
    )
    admin_host: str | None = Field(default=None, description="Address of the admin API; None: the RPC host.")
    admin_advertise: str | None = Field(
        default=None,
        description="host:port that tools and the other masters reach the admin API at (default: the address it "
        "is served on; name one where that is a wildcard such as 0.0.0.0, as in a Kubernetes pod).",
    )
    prometheus_url: str | None = Field(
        default=None,
        description="A Prometheus that evaluates docker/prometheus/alerts.yml over this cluster: the dashboard and "
        "`kvstore status` show its firing alerts (None, or when it does not answer: the master's own view of the "
        "rules it can judge).",
    )
    admin_token: str | None = Field(
        default=None,
        description="When set, every admin route but health, the dashboard page and its files needs"
        " 'Authorization: Bearer <token>' (also read from KVSTORE_ADMIN_TOKEN).",
    )
    etcd: str | None = Field(
        default=None,
        description="etcd endpoints host:port[,host:port]: run as leader or standby of cluster_id (HA).",
    )
    cluster_id: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="The HA cluster's id in etcd."
    )
    etcd_lease_ttl_s: int = Field(
        default=1, ge=1, le=60,
        description="The leader's etcd lease: a frozen or cut-off leader is replaced within about this (a killed "
        "one at once: see fence_refused). etcd grants at least "
        "1.5 x its election timeout, rounded up to whole seconds (2 s with its defaults; 1 s with "
        "--election-timeout=500 --heartbeat-interval=50, as this project's etcd runs); the leader fences itself "
        "within this TTL all the same.",
    )  # fmt: skip
    advertise: str | None = Field(
        default=None, description="host:port that clients and daemons reach this master at (default: host:port)."
    )
    ready_wait_ms: int = Field(
        default=1_000,
        ge=0,
        description="After taking over, longest wait for the nodes the daemons name before answering without them "
        "(live daemons register within ~0.1 s of a new leader; a node still missing is noted absent: its removed "
        "keys are dropped when it comes back). Every request waits meanwhile.",
    )
    takeover_hold_ms: int = Field(
        default=500,
        ge=0,
        le=60_000,
        description="Longest a request that comes while the master takes over waits for it to be ready before "
        "it is answered NotReady (the client then sends it again); 0: answered NotReady at once.",
    )
    cluster_secret_file: str | None = Field(
        default=None,
        description="File holding the cluster secret (also KVSTORE_CLUSTER_SECRET): every connection must then"
        " authenticate, daemons and tools with the secret, clients with a tenant's token.",
    )
    tenants_file: str | None = Field(
        default=None,
        description="TOML or JSON file of tenants (see `kvstore tenants add`); needs the cluster secret. Re-read"
        " when it changes.",
    )
    tls: TlsConfig | None = Field(
        default=None, description="Serve RPC and the admin API over TLS (needs cert_file); see TlsConfig."
    )
    ticket_ttl_s: int = Field(
        default=3600, ge=60, le=7 * 86400, description="How long a ticket the master gives a tenant is good for."
    )

    @model_validator(mode="after")
    def _check_ha(self) -> Self:
        if (self.etcd is None) != (self.cluster_id is None):
            raise ValueError(
                "cluster_id names an HA cluster in etcd and needs etcd endpoints (and etcd needs a cluster_id);"
                " without etcd a master runs alone: two masters of one cluster cannot agree who leads"
            )
        if self.node_ttl_ms < 2 * self.heartbeat_interval_ms or self.node_ttl_ms < 100:
            raise ValueError(
                f"node_ttl_ms ({self.node_ttl_ms}) must be at least two heartbeats ({self.heartbeat_interval_ms} ms"
                " each) and 100 ms: a daemon serves within a lease of 0.9 TTL - 20 ms from its last answered"
                " heartbeat, and the master fences a node silent for a whole TTL"
            )
        if self.key_lease_ms and not 2 * self.heartbeat_interval_ms <= self.key_lease_ms <= self.node_ttl_ms:
            raise ValueError(
                f"key_lease_ms ({self.key_lease_ms}) must be at least two heartbeats ({self.heartbeat_interval_ms}"
                f" ms each) and at most node_ttl_ms ({self.node_ttl_ms}), or 0: a daemon serves by key within it"
                " only while its heartbeats renew it"
            )
        return self

    @property
    def key_lease(self) -> int:
        """:attr:`key_lease_ms` as it applies (ms; 0: none)."""
        if self.key_lease_ms is not None:
            return self.key_lease_ms
        return min(3 * self.heartbeat_interval_ms, self.node_ttl_ms)


class DaemonConfig(_Frozen):
    """A storage daemon: one node's tiers and its data-plane server."""

    master: str = Field(
        default="127.0.0.1:50051",
        description="The master's host:port, or etcd://host:2379[,host:2379]/cluster-id for an HA cluster's leader.",
    )
    name: str = Field(default="node0", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Node id.")
    host: str = Field(default="127.0.0.1", description="Data-plane address to listen on and advertise.")
    port: int = Field(default=0, ge=0, le=65535, description="Data-plane port; 0 picks a free one.")
    rails: list[str] = Field(
        default_factory=list,
        description="More hosts to serve the data plane on, one per further NIC (multi-NIC); each gets a free port.",
    )
    ucx_port: int | None = Field(
        default=None, ge=0, le=65535, description="Also serve the data plane over UCX on this port (0: any free one)."
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Serve Prometheus metrics (the daemon's link to the master, its tiers' health) over HTTP on "
        "this port of host (0: any free one); off by default.",
    )  # fmt: skip
    dram: DramConfig = Field(default_factory=DramConfig)
    ssd: SsdConfig = Field(default_factory=SsdConfig)
    io_timeout_s: float = Field(default=30.0, gt=0, description="Bound on each network wait inside a request.")
    max_connections: int = Field(
        default=4096, ge=1, description="Data-plane connections served at once; more are closed at accept."
    )
    max_connections_per_peer: int = Field(
        default=1024,
        ge=1,
        description="Data-plane connections served at once from one peer address (every client process of a host "
        "shares its address, and so does the master's command link).",
    )
    cluster_secret_file: str | None = Field(
        default=None,
        description="File holding the cluster secret (also KVSTORE_CLUSTER_SECRET): the daemon then authenticates"
        " to the master and serves only connections that authenticate.",
    )
    tls: TlsConfig | None = Field(
        default=None,
        description="Reach the master over TLS; with data_plane, also serve the data port over TLS (needs"
        " cert_file). See TlsConfig.",
    )
    tenant_shm_writes: bool = Field(
        default=False,
        description="Take tenants' writes through the shared-memory arena (CommitBlocks of bytes a same-host"
        " client copied in). Off: a tenant writes through the socket, its seal checked, and maps the arena"
        " read-only; the cluster's own clients are not affected.",
    )
    commit_linger_ms: float = Field(
        default=1.0,
        ge=0,
        le=100,
        description="Cached puts' commits wait up to this long for more to join them in one request to the master"
        " (group commit: fewer requests a put, the master's CPU spared); a flush does not wait. 0: each round at once.",
    )
    orphan_check_s: float = Field(
        default=2.0,
        gt=0,
        description="Ask the master this long after a write of a key it dropped here earlier whether it knows"
        " the block (one whose put was given up before its bytes came is an orphan: dropped).",
    )
    inventory_sweep_s: float = Field(
        default=600.0,
        ge=0,
        description="Ask the master about every block held here once per this period (orphans from any"
        " cause are dropped); 0: only blocks of two-trip writes are asked about.",
    )
    leave_on_exit: bool = Field(
        default=False,
        description="On a clean stop, have the master forget this node and its blocks, and delete the arena"
        " (as a Mooncake client unmounts its segment at close); by default a restarted daemon re-attaches them.",
    )
    clamp_to_free: bool = Field(
        default=False,
        description="Where the machine has less free shared memory, memory or disk than dram.capacity or"
        " ssd.capacity ask for, start with what there is (with a warning) instead of refusing to start.",
    )


WRITE_FLOOR_BPS = 100e6
"""The slowest a write's bytes may go out before its daemon is given up: a client's two-trip write's
patience allows its own bytes this rate (:meth:`kvstore_client.core.ClientCore.write_patience_s`),
a request with patience on a pipelined link (:class:`transfer.link.AsyncLink`) the bytes queued
ahead of it."""


class ClientConfig(_Frozen):
    """The client library."""

    timeout_s: float = Field(default=10.0, gt=0, description="Bound on each network wait.")
    connections_per_daemon: int = Field(default=4, ge=1, le=64, description="Pooled data connections per node.")
    replicas: int = Field(default=1, ge=1, le=16, description="Default replicas of a put.")
    failover_ms: int = Field(
        default=100, ge=0,
        description="A read from a replica that has not begun answering within this goes to the block's next "
        "replica (the first is given up), as does a read by a remembered location (it asks the master then); "
        "a read with no other replica asks the master past failover_ms (then 2x, 4x that) whether it suspects the "
        "node (a miss if so: it missed heartbeats) and otherwise waits up to timeout_s, unless the read gave that "
        "node up already (its "
        "other replicas missed since) or the block has one copy, on a node a read gave up lately: then a miss "
        "after failover_ms. (A last replica after another answered "
        "that it does not hold the block is read only where the master still places the block.) 0: every "
        "read waits up to timeout_s.",
    )  # fmt: skip
    hedge_reads: bool = Field(
        default=True,
        description="A read with another replica to go to waits for its daemon only three times this client's "
        "recent p99 read time (at least 5 ms, at most failover_ms), then reads the next replica; at most 5% of "
        "reads are hedged so (kvstore_client.hedging). False: such reads wait failover_ms.",
    )  # fmt: skip
    put_retries: int = Field(default=20, ge=0, description="Retries of a put that the master asked to wait.")
    transport: Literal["auto", "tcp", "ucx"] = Field(
        default="auto",
        description="auto: shared memory with daemons on this host, UCX where both ends have RDMA, tcp otherwise;"
        " tcp: always tcp; ucx: UCX with every daemon that serves it (same-host ones too), tcp with the others.",
    )
    slice_bytes: ByteSize = Field(
        default=parse_size("1MiB"),
        gt=0,
        description="With several rails to a daemon, transfers are cut into slices of this size and sprayed over them.",
    )
    max_slices_in_flight: int = Field(default=8, ge=1, le=256, description="Bound on slices in flight per daemon.")
    rail_timeout_s: float = Field(
        default=2.0, gt=0, description="A slice silent this long fails its rail and moves to another rail."
    )
    rail_cooldown_s: float = Field(
        default=5.0, gt=0, description="A rail that keeps failing rests this long before it is tried again."
    )
    location_hints: int = Field(
        default=65536,
        ge=0,
        description="Keys whose last known node the client remembers: a get reads them from that node in one"
        " round trip (a miss there asks the master); 0 asks the master first for every get.",
    )
    grant_bytes: ByteSize = Field(
        default=parse_size("16MiB"),
        ge=0,
        description="Write space the client asks the master for ahead of its puts, so that a put is one round trip"
        " to a daemon (the master caps a grant at a fraction of a node's DRAM); 0: every put asks the master.",
    )
    put_mode: Literal["visible", "cached"] = Field(
        default="visible",
        description="When a put returns STORED. visible: every client's get finds the block. cached: the block is"
        " checked and committed in its daemon's arena, the master told after (a few ms; Store.flush() waits for"
        " it): this client reads it at once, others may miss it until then, never read other bytes. Only puts"
        " into granted space (one replica, over the daemon's socket) and not a tenant's are cached; the others"
        " are visible.",
    )
    token: str | None = Field(
        default=None,
        repr=False,
        description="A tenant's token (NAME.SECRET, from `kvstore tenants add`), for a cluster that authenticates;"
        " also read from KVSTORE_TOKEN.",
    )
    cluster_secret_file: str | None = Field(
        default=None,
        description="Connect as the cluster itself (operators' tools: every key, unscoped) with the secret in"
        " this file, instead of a tenant's token.",
    )
    tls: TlsConfig | None = Field(
        default=None,
        description="Reach the master over TLS (and daemons too, with data_plane), verifying them with ca_file.",
    )


class ConductorConfig(_Frozen):
    """The conductor: KVCache-aware scheduling of requests over prefill and decode workers."""

    host: str = Field(default="127.0.0.1", description="Address of the HTTP front door.")
    port: int = Field(default=8600, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    master: str | None = Field(
        default=None,
        description="The store master's host:port, or etcd://H:2379/cluster-id (the HA leader); None: load-only"
        " routing.",
    )
    cluster_secret_file: str | None = Field(
        default=None, description="The cluster secret, for a master that authenticates (also KVSTORE_CLUSTER_SECRET)."
    )
    tls: TlsConfig | None = Field(default=None, description="Reach the master over TLS (ca_file; see TlsConfig).")
    prefill: list[str] = Field(default=[], description="Base URLs of the prefill workers (``kvstore worker``).")
    decode: list[str] = Field(default=[], description="Base URLs of the decode workers (``kvstore worker``).")
    openai: list[str] = Field(
        default=[],
        description="Base URLs of OpenAI-compatible servers that prefill and decode their own requests (``vllm serve``"
        " with the KVStoreConnector), instead of prefill and decode workers.",
    )
    load_bytes_per_s: float = Field(
        default=1e9, gt=0, description="OpenAI servers: the rate at which a server loads stored KV (a start value)."
    )
    engine_events: list[str] = Field(
        default=[],
        description="OpenAI servers: each one's KV events endpoint (vLLM's --kv-events-config publisher, "
        "tcp://H:P), in the order of ``openai`` (\"\" for a server that publishes none). The conductor then "
        "knows which blocks each server's own cache holds from its events, not from what it sent it.",
    )  # fmt: skip
    engine_events_replay: list[str] = Field(
        default=[],
        description="OpenAI servers: each one's KV events replay endpoint (vLLM's replay_endpoint), or \"\".",
    )
    policy: Literal["random", "load", "local", "global"] = Field(default="global", description="Scheduling policy.")
    early_rejection: bool = Field(default=True, description="Reject at arrival on predicted TTFT and decode load.")
    decode_load: Literal["none", "current", "predicted"] = Field(
        default="predicted", description="The decode load early rejection checks."
    )
    ttft_slo_s: float = Field(default=30.0, gt=0, description="Time-to-first-token objective.")
    tbt_slo_s: float = Field(default=1.0, gt=0, description="Time-between-tokens objective.")
    balancing_threshold: float = Field(default=1.0, ge=1.0, description="Fetch when pool prefix > local x this.")
    replicate_tokens: int = Field(default=0, ge=0, description="Fetched tokens copied to the prefill node per request.")
    health_period_s: float = Field(default=1.0, gt=0, description="How often workers are health-checked.")
    master_timeout_s: float = Field(default=0.5, gt=0, description="Bound on one prefix lookup at the master.")
    request_timeout_s: float = Field(default=600.0, gt=0, description="Bound on one call to a worker.")
    start_timeout_s: float = Field(default=600.0, gt=0, description="How long to wait for the workers at start.")
    tokenizer: str | None = Field(default=None, description="A local tokenizer directory for text prompts.")

    @model_validator(mode="after")
    def _one_kind(self) -> ConductorConfig:
        if self.openai and (self.prefill or self.decode):
            raise ValueError("give prefill and decode workers, or OpenAI servers, not both")
        if not self.openai and not (self.prefill and self.decode):
            raise ValueError("give at least one prefill and one decode worker, or OpenAI servers (openai)")
        for name in ("engine_events", "engine_events_replay"):
            given = getattr(self, name)
            if given and len(given) != len(self.openai):
                raise ValueError(f"{name} names {len(given)} endpoints for {len(self.openai)} OpenAI servers")
        return self

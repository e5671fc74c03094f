"""The REST admin API's request and response models (pydantic): the OpenAPI document is made of them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from kvstore.placement.state import EvictionReason


class ErrorBody(BaseModel):
    code: int = Field(description="Stable error code of kvstore.errors (0 for HTTP-level errors).")
    error: str = Field(description="Error type.")
    message: str


class Health(BaseModel):
    status: Literal["ok"]
    uptime_s: float


class Ready(BaseModel):
    ready: bool
    nodes_up: int
    reason: str


class Leadership(BaseModel):
    role: str = Field(description='"leader", "standby", or "leader (lease unconfirmed)" while it may not serve.')
    ha: bool = Field(description="Whether the master runs with etcd (leader election, standbys).")
    ready: bool = Field(description="Whether it answers reads and puts (a new leader waits for the daemons).")
    epoch: int = Field(description="Leadership epoch: the revision of the leader key in etcd (0 without etcd).")
    leader: str | None = Field(description="The leader's RPC address as this master last saw it.")
    failovers: int = Field(description="Times this master took over as leader.")
    elections_won: int
    leadership_lost: int
    etcd_errors: int = Field(description="etcd requests that failed (the election retries them).")
    etcd: list[str] = Field(description="etcd endpoints.")
    etcd_reachable: bool
    cluster_id: str
    leader_epoch: int = Field(default=0, description="The epoch of the leader this master last saw in etcd.")
    lease_confirmed_s_ago: float | None = Field(
        default=None, description="Seconds since etcd last confirmed this master's lease (None: never; no etcd)."
    )


class TierUsage(BaseModel):
    capacity: int = Field(description="Bytes the tier can hold now (below `configured` while its disk is short).")
    configured: int = Field(description="Bytes the tier was configured with.")
    used: int
    blocks: int
    pinned: int
    leased: int


class Rates(BaseModel):
    gets_per_s: float
    puts_per_s: float
    hits_per_s: float
    read_bytes_per_s: float
    written_bytes_per_s: float


class ClusterSummary(BaseModel):
    nodes: int
    nodes_up: int
    nodes_down: int
    objects: int
    pending: int
    dram: TierUsage
    ssd: TierUsage
    hit_rate: float = Field(description="Hits over lookups since the master started (0 before any).")
    rates: Rates
    counters: dict[str, int]


class NicModel(BaseModel):
    name: str
    address: str
    speed_mbps: int
    numa_node: int


class NodeModel(BaseModel):
    node_id: str
    address: str
    rails: list[str]
    up: bool
    draining: bool
    last_heartbeat_ms_ago: int
    host_id: str
    ucx_address: str
    nics: list[NicModel]
    tiers: dict[str, TierUsage]
    faults: dict[str, str] = Field(description="By tier: why it holds less than configured (a full or failing disk).")
    commands_in_flight: int
    transfer_bytes: dict[str, int] = Field(description="Bytes the daemon moved, by transport:rail:direction.")


class NodeList(BaseModel):
    nodes: list[NodeModel]


class ReplicaModel(BaseModel):
    node_id: str
    tier: Literal["dram", "ssd"]
    offset: int
    status: Literal["ready", "moving", "copying", "dropping"] = Field(description="See ReplicaStatus.")
    moving: bool = Field(description="Not ready: a demotion, promotion, copy or drop of this replica is in flight.")
    dropping: bool = Field(description="A drop of this replica is in flight: reads no longer find it.")
    leased: bool
    node_up: bool


class KeyModel(BaseModel):
    key: str
    size: int
    checksum: int
    write_id: int = Field(description="The id of the put that wrote it (0: not known; see kvstore.write_ids).")
    pinned: bool
    state: Literal["committed", "writing", "removing"]
    replicas: list[ReplicaModel]


class KeyPage(BaseModel):
    keys: list[str]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last page.")


_KEY = Field(min_length=1, max_length=256, description="A block key: 1 to 256 bytes of UTF-8.")


class EvictKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = _KEY


class EvictPrefix(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix: str = Field(description="Every stored key that starts with this ('' is every key).")


class EvictTier(BaseModel):
    model_config = ConfigDict(extra="forbid")
    node_id: str
    tier: Literal["dram", "ssd"] = Field(description="dram: demote to SSD where it has room, else drop; ssd: drop.")


class EvictRequest(RootModel[EvictKey | EvictPrefix | EvictTier]):
    """Exactly one of: a key; a prefix; a node's tier."""


class EvictResult(BaseModel):
    evicted: int = Field(description="Blocks evicted (or, for a node's tier, demoted or dropped).")
    skipped_pinned: list[str]


class EvictionModel(BaseModel):
    seq: int = Field(description="Its number in this master's log (from 1, in order).")
    at: float = Field(description="Unix time (seconds) the master learned of it (within a tick of it).")
    key: str
    node_id: str = Field(description="The node it left; empty when it left every node (an operator's or a quota's).")
    reason: EvictionReason = Field(
        description="lru: room for other blocks; demotion_failed: a DRAM block its SSD refused; operator: the admin"
        " API; quota: room under its tenant's quota."
    )


class EvictionPage(BaseModel):
    evictions: list[EvictionModel]
    next_after: int = Field(description="Pass as ?after= for the next page (the last number looked at).")
    lost: int = Field(description="Evictions after ?after= the log's bound dropped before they were read.")


class DrainResult(BaseModel):
    node_id: str
    draining: bool
    blocks_left: int = Field(description="Blocks still on the node; it is out of placement from now on.")


class HistoryPoint(BaseModel):
    t: float = Field(description="Seconds since the epoch.")
    hit_rate: float | None = Field(description="Hits over lookups in this second; null when there were none.")
    gets_per_s: float
    puts_per_s: float
    read_bytes_per_s: float
    written_bytes_per_s: float
    dram_used: int
    ssd_used: int


class History(BaseModel):
    points: list[HistoryPoint]


class TenantUsage(BaseModel):
    tenant: str
    held_bytes: int = Field(description="Bytes it holds or reserves, as its quota counts them.")
    quota_bytes: int = Field(description="Its quota (0: none).")
    sessions: int = Field(description="Sessions it has open on this master.")
    requests: int = Field(description="Requests its sessions sent this master since it started.")
    requests_per_s: float = Field(description="Of those, per second over the last few seconds.")


class TenantUsageList(BaseModel):
    tenants: list[TenantUsage] = Field(description="Every tenant of the tenants file (none without one).")


class MasterView(BaseModel):
    address: str = Field(description="Its RPC address.")
    admin: str | None = Field(description="Its admin API's address.")
    role: str = Field(
        description='"leader", "standby", "leader (lease unconfirmed)", "unreachable" (its admin API did not '
        'answer) or "unknown" (not asked: see error).'
    )
    leader_epoch_seen: int | None = Field(description="The epoch of the leader it last saw in etcd.")
    follows: bool | None = Field(
        description="Whether it saw the current leader (a standby takes over from what the daemons report: it "
        "replays no log, so this is how far behind it can be)."
    )
    lease_confirmed_s_ago: float | None = Field(description="Seconds since etcd last confirmed its lease.")
    etcd_reachable: bool | None
    ready: bool | None
    error: str = Field(default="", description="Why it was not asked, or did not answer.")


class MasterList(BaseModel):
    cluster_id: str
    leader: str | None = Field(description="The leader's RPC address, as etcd names it to this master.")
    epoch: int = Field(description="The leader's epoch (the create revision of its key in etcd).")
    masters: list[MasterView]
    error: str = Field(default="", description="Why only this master is listed (etcd does not answer it).")


class AlertModel(BaseModel):
    name: str
    severity: str
    labels: dict[str, str]
    summary: str
    value: float | None = None
    since_s: float | None = Field(default=None, description="Seconds it has held (the master's own view).")


class AlertList(BaseModel):
    source: str = Field(description='"prometheus" (its URL was given and answered) or "master" (its own view).')
    error: str = Field(default="", description="Why the Prometheus URL given did not answer (then: the master's).")
    alerts: list[AlertModel] = Field(description="Alerts firing now.")
    not_judged: dict[str, str] = Field(
        default_factory=dict, description="Rules the master's own view cannot judge, and why (source master)."
    )

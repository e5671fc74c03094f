"""Daemon -> master: a node joins (registers its inventory), stays (heartbeats, access reports) and leaves.

Also :class:`MasterHello`, the first frame of a master's connection to a daemon, which fences
off the commands of a deposed master, and :class:`NodeInfo`, how clients reach a node's data.
"""

from __future__ import annotations

from kvstore.protocol.base import InventoryItem, Message, Struct, Tier


class Nic(Struct, frozen=True):
    """One network interface of a host, as :mod:`transfer.topology` reads it."""

    name: str
    address: str
    speed_mbps: int
    """-1: the link reports no speed (loopback, veth)."""
    numa_node: int
    """-1: unknown or not a NUMA machine."""


class NodeInfo(Struct, frozen=True):
    """How clients reach a node's data: its rails, and whether they share its host (and its arena)."""

    node_id: str
    address: str
    rails: list[str]
    """Data-plane addresses, one per NIC the daemon serves on; ``address`` is the first."""
    host_id: str
    arena_path: str
    """The DRAM arena's shared-memory file: a client on the same host maps it."""
    arena_inode: int
    """Tells the same file from one of the same name elsewhere (another container's /dev/shm)."""
    nics: list[Nic]
    rdma: bool
    """The node has an RDMA device (UCX can use verbs rather than TCP)."""
    ucx_address: str
    """host:port of the node's UCX data plane; empty when it serves none."""
    up: bool


class RegisterNode(Message, tag=10, frozen=True):
    node_id: str
    address: str
    dram_capacity: int
    ssd_capacity: int
    alignment: int
    inventory: list[InventoryItem]
    rails: list[str]
    host_id: str
    arena_path: str
    arena_inode: int
    nics: list[Nic]
    rdma: bool
    ucx_address: str
    max_blocks: int
    """Blocks the DRAM arena can index at most (its index grows to this as blocks arrive); 0: no
    limit but capacity."""
    peers: list[str]
    """Node ids a master last told this daemon were in the cluster: a master that has just taken
    over waits for them (their inventories) before it answers reads and puts."""


class RegisterReply(Message, tag=11, frozen=True):
    heartbeat_interval_ms: int
    node_ttl_ms: int
    """The master fences a node silent this long (see kvstore.placement.nodes): its daemon serves by
    key only within a lease shorter than this from the sending of its last answered heartbeat."""
    epoch: int
    """The master's leadership epoch (the revision of its etcd leader key; 0 without etcd). The
    daemon refuses commands from masters of an older epoch (see MasterHello)."""
    peers: list[str]
    drops: list[str] = []
    """Blocks of the inventory the master did not adopt (a removed key, a copy another node holds
    with other bytes), each with its tier in ``drop_tiers``: the daemon drops them before it serves."""
    drop_tiers: list[str] = []
    """Per block of ``drops``: "dram" or "ssd" (that copy only), "" (wherever it is)."""
    key_lease_ms: int = 0
    """The lease within which the daemon serves reads by key alone (see MasterConfig.key_lease_ms),
    renewed by heartbeats answered with ``HeartbeatReply.key_lease``; 0: by key as by location."""


class Heartbeat(Message, tag=12, frozen=True):
    node_id: str
    transfer_bytes: dict[str, int]
    """Bytes the daemon moved since it started, by "transport|rail|direction" (for /metrics)."""
    ssd_capacity: int = -1
    """What the SSD tier can hold now: lowered from ``ssd_configured`` when its disk filled or
    failed a write (-1: as registered)."""
    ssd_configured: int = -1
    """The SSD tier's configured capacity (-1: as registered)."""
    ssd_fault: str = ""
    """Why ``ssd_capacity`` is below ``ssd_configured`` ("" while the tier is healthy)."""
    refusals: dict[str, int] = {}
    """What the daemon refused since it started, by kind (connections over a limit, logins that
    failed or came too late, tenants' sessions cut, replayed reservations): for /metrics."""


class HeartbeatReply(Message, tag=13, frozen=True):
    known: bool
    """False when the master does not know the node (it restarted): the daemon re-registers."""
    peers: list[str]
    """The nodes the master knows now (see RegisterNode.peers)."""
    key_lease: bool = True
    """Whether this answer renews the daemon's lease to serve by key (RegisterReply.key_lease_ms):
    not while the node owes the master drops past that lease (a remove answered without them)."""


class CheckBlocks(Message, tag=90, frozen=True):
    """A daemon asks whether the master knows blocks it holds (written by puts the master may have
    given up on before their bytes came: orphans). Each as the daemon holds it: its DRAM offset (-1
    on SSD), size and checksum. ``dropped``: orphans of an earlier answer, now dropped (the master
    gives their extents back)."""

    node_id: str
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    dropped: list[str] = []


class CheckBlocksReply(Message, tag=91, frozen=True):
    orphans: list[bool]
    """Per block, True when the master does not know it on that node: the daemon drops it (its
    DRAM extent is kept out of the master's free space until ``dropped`` says it is gone)."""


class MasterHello(Message, tag=14, frozen=True):
    """First frame of a master's connection to a daemon: the commands that follow on it are the
    master's of ``epoch``. A daemon that has registered with a master of a later epoch refuses
    them (NotLeader): a deposed leader can no longer drop, move or grant anything."""

    epoch: int


class AccessReport(Message, tag=73, frozen=True):
    """Blocks a daemon served by key since its last report (reads that asked the master nothing),
    each with the tier it was read from: the master counts the hits and keeps its LRU order. The
    tier is the one at the read: a report may come after the block moved (a read of a DRAM block
    demoted since is no SSD hit, and promotes nothing)."""

    node_id: str
    keys: list[str]
    tiers: list[Tier]


class ReportNode(Message, tag=92, frozen=True):
    """A client could not reach ``node_id``'s daemon (the connection was refused or dropped): the
    master looks at once whether its process is gone, and fences it if so (see
    ``MasterConfig.fence_refused``) instead of after its TTL. Answered by OkReply; a report of a
    node that answers the master changes nothing."""

    node_id: str


class LeaveNode(Message, tag=88, frozen=True):
    """A daemon leaves for good (``kvstore daemon --leave-on-exit``, as a Mooncake client unmounts
    its segment at close): the master forgets the node and every replica on it. Answered by OkReply."""

    node_id: str

"""The client's data plane: one interface to a node's bytes, one implementation per transport, and
one selector that picks it per node for reads and writes alike.

A :class:`DataPath` reads blocks the master located (``read``), writes blocks into extents the
master reserved (``write``), and, where the transport goes through the daemon's socket server,
reads blocks by key alone (``read_direct``, the one-trip read) and writes into granted space
(``write_granted``, the one-trip put). Which transport moves the bytes is decided once per node
by :class:`PathSelector`: shared memory when the node's arena is on this host, UCX where asked for
or where both ends have RDMA, sliced over rails when the node serves on several NICs, else TCP.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.arena_format import ArenaMapping
from kvstore.auth import Credential
from kvstore.config import ClientConfig
from kvstore.errors import ProtocolError
from kvstore.protocol import FlushCommits, NodeInfo, OkReply, PutReply, ReadReply, ReplicaRef, WriteReply
from kvstore_client.effects import (
    Block,
    Direct,
    FlushCached,
    Job,
    Located,
    PutGranted,
    ReadDirect,
    ReadLocated,
    ReadRanges,
    WriteReserved,
    commit_message,
    granted_message,
    ranges_message,
    read_by_key_message,
    read_message,
    seals,
    write_ids,
    write_message,
)
from kvstore_client.puts import write_codes
from transfer import topology
from transfer.auth import CredentialSource
from transfer.rails import RailSet
from transfer.rpc import ConnectionPool
from transfer.transports import ucx
from transfer.transports.shm import ShmTransport
from transfer.transports.ucx import UcxClient
from transfer.wire import recv_parts, recv_read_reply


class DataPath:
    """How this client moves one node's bytes. The base class speaks TCP to the daemon."""

    direct = True
    """Whether ``read_direct``/``write_granted`` go through the daemon (one-trip paths)."""

    def __init__(self, node_id: str, address: str, pool: ConnectionPool) -> None:
        self.node_id = node_id
        self.address = address
        self.pool = pool

    def read(self, blocks: Sequence[Located], patience_s: float = 0.0) -> list[int | None]:
        """Read located blocks into their buffers; per block its size, None for a miss (a block of
        another size than the master described is a stale copy: a miss). ``patience_s``: a Timeout
        when the daemon has not begun answering within it (0: the pool's timeout); the paths that
        do not go through the daemon's socket (shared memory, UCX, rails) wait their own way."""
        message = read_message(blocks)
        targets = [view[: loc.size] for loc, _, view in blocks]
        conn = self.pool.acquire()
        try:
            with conn.exchange(message, patience=patience_s) as (reply, sock):
                got = recv_read_reply(reply, sock, targets, f"ReadBlocks from {self.address}")
        finally:
            self.pool.release(conn)
        return [loc.size if ok else None for ok, (loc, _, _) in zip(got, blocks, strict=True)]

    def read_direct(
        self, keys: Sequence[str], views: Sequence[memoryview | None], exact_size: bool = False,
        patience_s: float = 0.0,
    ) -> tuple[list[Direct | None], list[bytearray | None]]:  # fmt: skip
        """Read blocks by key alone, in one round trip: per key its (size, checksum) or None for a
        miss; a None view gets a new buffer (returned beside). A block larger than its view, or of
        another size with ``exact_size``, is skipped as a miss. ``patience_s``: as in :meth:`read`."""
        message = read_by_key_message(keys)
        out: list[Direct | None] = [None] * len(keys)
        made: list[bytearray | None] = [None] * len(keys)
        conn = self.pool.acquire()
        try:
            with conn.exchange(message, patience=patience_s) as (reply, sock):
                if not isinstance(reply, ReadReply) or not len(reply.sizes) == len(reply.checksums) == len(keys):
                    raise ProtocolError(f"{self.address} sent a malformed reply to ReadBlocks")
                targets: list[memoryview | int] = []
                for i, (size, check) in enumerate(zip(reply.sizes, reply.checksums, strict=True)):
                    if size < 0:
                        continue
                    view = views[i]
                    if view is None:
                        buf = made[i] = bytearray(size)
                        view = memoryview(buf)
                    elif size > view.nbytes or (exact_size and size != view.nbytes):
                        targets.append(size)  # not this block: its bytes dropped
                        continue
                    targets.append(view[:size])
                    out[i] = Direct(size, check)
                recv_parts(sock, targets)
        finally:
            self.pool.release(conn)
        return out, made

    def read_ranges(self, blocks: Sequence[Located], start: int, length: int) -> list[bool]:
        """Read bytes ``[start, start + length)`` of blocks into their buffers (each ``length`` long)."""
        message = ranges_message([loc.key for loc, _, _ in blocks], start, length)
        conn = self.pool.acquire()
        try:
            with conn.exchange(message) as (reply, sock):
                return recv_read_reply(reply, sock, [v for _, _, v in blocks], f"ReadSlices from {self.address}")
        finally:
            self.pool.release(conn)

    def write(self, blocks: Sequence[Block], pinned: bool, patience_s: float = 0.0) -> list[tuple[int, str]]:
        """Write blocks into extents the master reserved and have the daemon commit them;
        per block (0, "") or an error's (code, text). ``patience_s``: a Timeout (the connection
        closed) when the daemon has not begun answering within it once the bytes went out."""
        reply = self.pool.call(write_message(blocks, pinned), WriteReply, [b.view for b in blocks], patience=patience_s)
        return write_codes(reply.codes, reply.errors, len(blocks), self.address)

    def write_granted(
        self, grant_id: int, blocks: Sequence[Block], pinned: bool, cached: bool = False
    ) -> list[tuple[int, str]]:
        """A put in one round trip: write into a grant; per block PUT_STORED, PUT_EXISTS or an error code."""
        message = granted_message(grant_id, blocks, pinned, cached)
        reply = self.pool.call(message, PutReply, [b.view for b in blocks])
        return write_codes(reply.codes, reply.errors, len(blocks), self.address)

    def flush_cached(self) -> None:
        """Wait until the daemon has told the master of every cached put it acknowledged."""
        self.pool.call(FlushCommits(), OkReply)

    def close(self) -> None:
        """Resources of this path alone (pools are the selector's)."""


class ShmPath(DataPath):
    """A node on this host: bytes are copied through its mapped arena; the daemon only commits."""

    direct = False

    def __init__(self, node_id: str, address: str, pool: ConnectionPool, shm: ShmTransport, arena: ArenaMapping):
        super().__init__(node_id, address, pool)
        self.shm = shm
        self.arena = arena

    def read(self, blocks: Sequence[Located], patience_s: float = 0.0) -> list[int | None]:
        dram = [(loc, r, v) for loc, r, v in blocks if r.tier == "dram"]
        if dram:
            self.shm.read_many([(self.arena, r.offset, loc.size, v) for loc, r, v in dram])
        ssd = [(loc, r, v) for loc, r, v in blocks if r.tier != "dram"]
        from_ssd = iter(super().read(ssd, patience_s) if ssd else [])
        return [loc.size if r.tier == "dram" else next(from_ssd) for loc, r, _ in blocks]

    def read_ranges(self, blocks: Sequence[Located], start: int, length: int) -> list[bool]:
        dram = [(loc, r, v) for loc, r, v in blocks if r.tier == "dram"]
        for _, r, view in dram:
            ShmTransport.read(self.arena, r.offset + start, length, view)
        ssd = [(loc, r, v) for loc, r, v in blocks if r.tier != "dram"]
        from_ssd = iter(super().read_ranges(ssd, start, length) if ssd else [])
        return [True if r.tier == "dram" else next(from_ssd) for _, r, _ in blocks]

    def write(self, blocks: Sequence[Block], pinned: bool, patience_s: float = 0.0) -> list[tuple[int, str]]:
        if not self.arena.writable:
            return super().write(blocks, pinned, patience_s)  # a tenant's: through the daemon's socket
        self.shm.write_many(self.arena, [(b.offset, b.view) for b in blocks])
        reply = self.pool.call(commit_message(blocks, pinned), WriteReply, patience=patience_s)
        return write_codes(reply.codes, reply.errors, len(blocks), self.address)


class UcxPath(DataPath):
    """A node reached over UCX (RDMA where both ends have it): the master leases what is read."""

    direct = False

    def __init__(self, node_id: str, address: str, pool: ConnectionPool, client: UcxClient, ucx_address: str):
        super().__init__(node_id, address, pool)
        self.client = client
        self.ucx_address = ucx_address

    def read(self, blocks: Sequence[Located], patience_s: float = 0.0) -> list[int | None]:
        return self.client.read(
            self.ucx_address, [loc.key for loc, _, _ in blocks], [loc.size for loc, _, _ in blocks],
            [view for _, _, view in blocks],
        )  # fmt: skip

    def write(self, blocks: Sequence[Block], pinned: bool, patience_s: float = 0.0) -> list[tuple[int, str]]:
        # UCX's own timeout bounds it (no patience there yet: a frozen node costs it).
        reply = self.client.write(write_message(blocks, pinned), self.ucx_address, [b.view for b in blocks])
        return write_codes(reply.codes, reply.errors, len(blocks), self.ucx_address)


class RailPath(DataPath):
    """A node serving on several NICs: transfers are cut into slices sprayed over its rails (and
    moved off a failing rail); small one-trip calls go over its first rail."""

    direct = False  # large transfers are sliced over every rail, which needs the sizes first

    def __init__(self, node_id: str, address: str, pool: ConnectionPool, railset: RailSet):
        super().__init__(node_id, address, pool)
        self.railset = railset

    def read(self, blocks: Sequence[Located], patience_s: float = 0.0) -> list[int | None]:
        return self.railset.read(
            [loc.key for loc, _, _ in blocks], [loc.size for loc, _, _ in blocks],
            [loc.checksum for loc, _, _ in blocks], [view for _, _, view in blocks],
        )  # fmt: skip

    def write(self, blocks: Sequence[Block], pinned: bool, patience_s: float = 0.0) -> list[tuple[int, str]]:
        # Slices over every rail, each its own exchange: the connection's timeout bounds them.
        return self.railset.write(
            [b.key for b in blocks], [b.offset for b in blocks], [b.checksum for b in blocks],
            [b.view for b in blocks], pinned, seals(blocks), write_ids(blocks),
        )  # fmt: skip

    def close(self) -> None:
        self.railset.close()


class PathSelector:
    """Picks, once per node, the data path this client uses for that node in both directions."""

    def __init__(
        self,
        config: ClientConfig,
        lookup: Callable[[str], NodeInfo | None],
        credential: CredentialSource | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``credential``: what connections to daemons prove themselves with (None: nothing);
        ``tls``: their TLS context (None: plain; same-host shared memory and UCX are never TLS)."""
        self.config = config
        self.credential = credential
        self.tls = tls
        self._lookup = lookup
        self._lock = threading.RLock()
        self._pools: dict[str, ConnectionPool] = {}
        self._paths: dict[str, tuple[NodeInfo | None, DataPath]] = {}
        # A tenant's client maps same-host arenas read-only: other tenants' bytes are there too.
        cluster = credential is None or (isinstance(credential, Credential) and credential.kind == "cluster")
        self._shm = ShmTransport(writable=cluster) if config.transport == "auto" else None
        self._ucx: UcxClient | None = None
        self._checked: dict[str, float] = {}

    def pool(self, address: str) -> ConnectionPool:
        pool = self._pools.get(address)
        if pool is None:
            with self._lock:
                pool = self._pools.get(address)
                if pool is None:
                    pool = ConnectionPool(
                        address, self.config.timeout_s, self.config.connections_per_daemon, self.credential, self.tls,
                        bounded=False,
                    )  # fmt: skip
                    self._pools[address] = pool
        return pool

    def path(self, node_id: str, address: str) -> DataPath:
        """The path to ``node_id`` (at ``address``, as the master or a hint said)."""
        known = self._paths.get(node_id)
        if known is not None and known[1].address == address:
            return known[1]
        node = self._lookup(node_id)
        with self._lock:
            known = self._paths.get(node_id)
            if known is not None and known[1].address == address and known[0] is node:
                return known[1]
            if known is not None:
                known[1].close()
            chosen = self._choose(node_id, address, node)
            self._paths[node_id] = (node, chosen)
            return chosen

    def _choose(self, node_id: str, address: str, node: NodeInfo | None) -> DataPath:
        pool = self.pool(address)
        if node is None or node.address != address:
            return DataPath(node_id, address, pool)  # not (yet) described: plain TCP to where it was seen
        cfg = self.config
        arena = self._shm.arena(node) if self._shm is not None else None
        if arena is not None:
            assert self._shm is not None
            return ShmPath(node_id, address, pool, self._shm, arena)
        if cfg.transport != "tcp" and node.ucx_address and self.tls is None:  # UCX is not TLS
            wanted = cfg.transport == "ucx" or (node.rdma and topology.has_rdma() and ucx.available())
            if wanted:
                if self._ucx is None:
                    self._ucx = UcxClient(cfg.timeout_s)
                return UcxPath(node_id, address, pool, self._ucx, node.ucx_address)
        if len(node.rails) >= 2:
            railset = RailSet(
                node.rails, timeout=cfg.rail_timeout_s, slice_bytes=cfg.slice_bytes,
                max_inflight=cfg.max_slices_in_flight, cooldown_s=cfg.rail_cooldown_s, credential=self.credential,
                tls=self.tls,
            )  # fmt: skip
            return RailPath(node_id, address, pool, railset)
        return DataPath(node_id, address, pool)

    def one_trip(self, node_id: str, address: str) -> bool:
        """Whether reads by key and writes into grants of this node go through its daemon's socket."""
        return self.path(node_id, address).direct

    def local(self, replica: ReplicaRef) -> bool:
        """Whether this client copies ``replica`` out of a mapped arena, without its daemon."""
        return replica.tier == "dram" and isinstance(self.path(replica.node_id, replica.address), ShmPath)

    def run(self, job: Job) -> Any:
        """Carry out one daemon job of the client core (see :mod:`kvstore_client.effects`)."""
        path = self.path(job.node_id, job.address)
        if isinstance(job, ReadLocated):
            return path.read(job.blocks, job.patience_s)
        if isinstance(job, ReadDirect):
            return path.read_direct(job.keys, job.views, job.exact_size, job.patience_s)
        if isinstance(job, ReadRanges):
            return path.read_ranges(job.blocks, job.start, job.length)
        if isinstance(job, WriteReserved):
            return path.write(job.blocks, job.pinned, job.patience_s)
        if isinstance(job, FlushCached):
            return path.flush_cached()
        assert isinstance(job, PutGranted)
        return path.write_granted(job.grant_id, job.blocks, job.pinned, job.cached)

    @property
    def may_lease(self) -> bool:
        """Whether some path of this client reads without the daemon (so gets must be leased)."""
        return self.config.transport != "tcp"

    def close(self) -> None:
        with self._lock:
            for _, path in self._paths.values():
                path.close()
            self._paths.clear()
            for pool in self._pools.values():
                pool.close()
            if self._shm is not None:
                self._shm.close()
            if self._ucx is not None:
                self._ucx.close()

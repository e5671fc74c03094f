"""Same-host transfers through a daemon's DRAM arena, with no bytes on a socket.

A daemon's arena is a file in /dev/shm. A client on the same host (the same
``host_id`` and the same file, by inode) maps it and copies extents directly:
reads while it holds the master's lease on the block, writes into the extent
the master reserved for its put (the daemon then checks and commits the block
in place, on a ``CommitBlocks`` message). Anything else uses the network.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.arena_format import ArenaMapping
from kvstore.errors import KVStoreError
from kvstore.protocol import NodeInfo
from transfer import topology

log = logging.getLogger("kvstore.transfer.shm")

PARALLEL_BYTES = 8 << 20
"""A batch of copies of at least this many bytes is cut into pieces that several threads copy."""
PIECE_BYTES = 4 << 20
MAX_COPY_THREADS = 8


def _copy_pieces(pieces: Sequence[tuple[memoryview, memoryview]]) -> None:
    for dst, src in pieces:
        # numpy's copy releases the GIL (a memoryview assignment does not), so threads copy at once.
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class Copier:
    """Copies batches of byte ranges; a large batch on several threads, since one core's copy falls
    well short of the memory bandwidth (the arena -> pinned buffer leg of a GPU load, say)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads if threads is not None else min(MAX_COPY_THREADS, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def copy(self, pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
        """Copy each ``src`` into the start of its ``dst``."""
        total = sum(src.nbytes for _, src in pairs)
        if self.threads == 1 or total < PARALLEL_BYTES:
            for dst, src in pairs:
                dst[: src.nbytes] = src
            return
        pieces = [
            (dst[at : at + PIECE_BYTES], src[at : min(at + PIECE_BYTES, src.nbytes)])
            for dst, src in pairs
            for at in range(0, src.nbytes, PIECE_BYTES)
        ]
        pieces = [(d[: s.nbytes], s) for d, s in pieces]
        workers = min(self.threads, len(pieces))
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kvstore-copy")
            pool = self._pool
        futures = [pool.submit(_copy_pieces, pieces[i::workers]) for i in range(workers)]
        for future in futures:
            future.result()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class ShmTransport:
    """The arenas of the daemons on this host, mapped on first use."""

    def __init__(self, writable: bool = True) -> None:
        """``writable``: map arenas for writes too; a tenant's client maps them read-only (its writes
        go through the daemon's socket, checked against the master's seals)."""
        self.writable = writable
        self.host_id = topology.host_id()
        self._maps: dict[tuple[str, int], ArenaMapping | None] = {}
        self._lock = threading.Lock()
        self.copier = Copier()

    def arena(self, node: NodeInfo) -> ArenaMapping | None:
        """The node's mapped arena when it shares this host; None when it does not, or cannot be mapped."""
        if node.host_id != self.host_id or not node.arena_path:
            return None
        key = (node.arena_path, node.arena_inode)
        with self._lock:
            if key in self._maps:
                return self._maps[key]
            mapping: ArenaMapping | None = None
            if topology.same_file(node.arena_path, node.arena_inode):
                try:
                    mapping = ArenaMapping(node.arena_path, self.writable)
                except KVStoreError as exc:
                    log.info("node %s shares this host but its arena cannot be mapped: %s", node.node_id, exc)
                if mapping is not None and mapping.inode != node.arena_inode:
                    mapping.close()  # replaced between the check and the open
                    mapping = None
            self._maps[key] = mapping
            return mapping

    @staticmethod
    def read(arena: ArenaMapping, offset: int, size: int, dst: memoryview) -> None:
        """Copy a leased block's ``size`` bytes at ``offset`` into ``dst``."""
        src = arena.extent(offset, size)
        try:
            dst[:size] = src
        finally:
            src.release()

    @staticmethod
    def write(arena: ArenaMapping, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the reserved extent at ``offset``."""
        dst = arena.extent(offset, src.nbytes)
        try:
            dst[:] = src
        finally:
            dst.release()

    def read_many(self, reads: Sequence[tuple[ArenaMapping, int, int, memoryview]]) -> None:
        """For each (arena, offset, size, dst): copy a leased block into ``dst``, the batch on several threads."""
        extents = [arena.extent(offset, size) for arena, offset, size, _ in reads]
        try:
            self.copier.copy([(dst, src) for (_, _, _, dst), src in zip(reads, extents, strict=True)])
        finally:
            for extent in extents:
                extent.release()

    def write_many(self, arena: ArenaMapping, writes: Sequence[tuple[int, memoryview]]) -> None:
        """For each (offset, src): copy ``src`` into its reserved extent, the batch on several threads."""
        extents = [arena.extent(offset, src.nbytes) for offset, src in writes]
        try:
            self.copier.copy([(dst, src) for dst, (_, src) in zip(extents, writes, strict=True)])
        finally:
            for extent in extents:
                extent.release()

    def close(self) -> None:
        self.copier.close()
        with self._lock:
            for mapping in self._maps.values():
                if mapping is not None:
                    mapping.close()
            self._maps.clear()

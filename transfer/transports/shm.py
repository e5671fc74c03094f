"""Same-host transfers through a daemon's DRAM arena, with no bytes on a socket.

A daemon's arena is a file in /dev/shm. A client on the same host (the same
``host_id`` and the same file, by inode) maps it and copies extents directly:
reads while it holds the master's lease on the block, writes into the extent
the master reserved for its put (the daemon then checks and commits the block
in place, on a ``CommitBlocks`` message). Anything else uses the network.
"""

from __future__ import annotations

import logging
import threading

from kvstore.errors import KVStoreError
from kvstore.protocol import NodeInfo
from kvstore.tiers.dram import ArenaMapping
from transfer import topology

log = logging.getLogger("kvstore.transfer.shm")


class ShmTransport:
    """The arenas of the daemons on this host, mapped on first use."""

    def __init__(self) -> None:
        self.host_id = topology.host_id()
        self._maps: dict[tuple[str, int], ArenaMapping | None] = {}
        self._lock = threading.Lock()

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
                    mapping = ArenaMapping(node.arena_path)
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

    def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                if mapping is not None:
                    mapping.close()
            self._maps.clear()

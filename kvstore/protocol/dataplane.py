"""Client -> daemon, the data plane: writes and reads of blocks, whose bytes follow the frame.

A write's bytes follow its frame, concatenated in order; so do those of a read's reply. Large
blocks travel as slices sprayed over rails (:class:`WriteSlices`, :class:`ReadSlices`);
bytes already in place (a same-host client's copy) are committed by :class:`CommitBlocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import KVStoreError
from kvstore.protocol.base import Message


class WriteBlocks(Message, tag=60, frozen=True):
    """Write blocks into reserved DRAM extents; their bytes follow the frame, concatenated in order."""

    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    """The batch was put with pin=True; the daemon records it so that pins survive a master restart."""
    seals: list[bytes] = []
    """Per block, the master's seal of its reservation: a tenant's write lands only where the master
    reserved for it (empty for the cluster's own writes and on a cluster without authentication)."""
    write_ids: list[int] = []
    """Per block, the write id of the put that wrote it (:mod:`kvstore.write_ids`; empty: none), kept
    with the block and reported in the node's inventory."""


class WriteSlices(Message, tag=66, frozen=True):
    """Write byte ranges of blocks into their reserved extents (the slices of large blocks, sprayed over rails).

    Each block is reserved by its first slice to arrive, on whichever rail; its bytes follow the
    frame, slice after slice. Answered by a WriteReply per slice; the blocks stay invisible until a
    CommitBlocks names them."""

    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    starts: list[int]
    lengths: list[int]
    seals: list[bytes] = []
    """Per slice, its block's reservation seal (as in WriteBlocks)."""


class CommitBlocks(Message, tag=64, frozen=True):
    """Commit blocks whose bytes are already in their reserved DRAM extents: copied there by a
    same-host client, or written by WriteSlices.

    Nothing follows the frame; the daemon checks each block's checksum in place."""

    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    seals: list[bytes] = []
    """Per block, its reservation seal (as in WriteBlocks)."""
    write_ids: list[int] = []
    """Per block, its put's write id (as in WriteBlocks)."""


class WriteReply(Message, tag=61, frozen=True):
    codes: list[int]
    """0 for a block stored, else the code of the error in :mod:`kvstore.errors`."""
    errors: list[str]

    @classmethod
    def from_outcomes(cls, outcomes: Sequence[KVStoreError | None]) -> WriteReply:
        """Per block None (stored) or the error that refused it."""
        return cls([0 if e is None else e.code for e in outcomes], ["" if e is None else str(e) for e in outcomes])


class ReadBlocks(Message, tag=62, frozen=True):
    keys: list[str]
    tiers: list[str]
    """Where the master last saw each block; a daemon reads by key, so these are hints."""
    offsets: list[int]
    sizes: list[int]


class ReadSlices(Message, tag=65, frozen=True):
    """Read byte ranges of blocks (one slice of a large block per entry, for spraying over several rails).

    Answered by a ReadReply: per slice the bytes sent, -1 when the block is not held or the
    range does not lie inside it."""

    keys: list[str]
    starts: list[int]
    lengths: list[int]


class ReadReply(Message, tag=63, frozen=True):
    """Sizes of the blocks read (-1: not held) and their checksums (0 for those not held); the bytes
    of those held follow the frame, in order."""

    sizes: list[int]
    checksums: list[int]

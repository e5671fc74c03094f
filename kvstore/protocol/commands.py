"""Master -> daemon commands: move blocks between tiers, drop them, copy them from another daemon.

Each is answered by a :class:`CommandReply` (per key, whether it was done).
"""

from __future__ import annotations

from typing import Literal

from kvstore.protocol.base import Message


class DemoteBlocks(Message, tag=50, frozen=True):
    """Move blocks from the DRAM arena to the SSD tier, freeing their extents."""

    keys: list[str]


class DropBlocks(Message, tag=51, frozen=True):
    """Delete blocks: from whichever tier holds them, or with ``tier`` only from that one (a key
    held in both tiers keeps its other copy)."""

    keys: list[str]
    tier: Literal["", "dram", "ssd"] = ""
    fences: list[int] = []
    """For copies the master gave up on (a drain's or a replicate's), per key the DRAM offset the
    copy was planned into: one that has not arrived is refused when it comes (empty: none)."""
    void_until_ms: int = 0
    """Tenants' seals of these keys that end at or before this (the master's wall clock, ms) are
    refused from now on, used or not: a reservation given up (revoked, expired, its key removed)
    cannot be written after its drop. The master seals every later reservation of a key to end
    after it. 0: none."""
    at: list[int] = []
    """For reservations given up, per key the DRAM offset reserved: a block of the key that lies
    elsewhere is not the one given up (a cached put into a grant, its commit not yet taken by the
    master) and stays. Empty: whatever the daemon holds under each key."""
    keep_pending: bool = False
    """Blocks of puts begun with an earlier master (no reservation of them is known): a cached put's
    block on the daemon, its commit pending or lately taken by the master, is not one and stays
    (the master takes no commit of these keys until the drop is answered)."""


class PromoteBlocks(Message, tag=52, frozen=True):
    """Move SSD blocks into the DRAM arena at the given offsets."""

    keys: list[str]
    offsets: list[int]


class FetchBlocks(Message, tag=54, frozen=True):
    """Copy blocks from another daemon (a drain, a replicate): read them by key from ``source`` into
    the given reserved DRAM extents here, check their checksums and commit them, each pinned as
    ``pinned`` says (empty: none; a master before it sent none). Answered by a CommandReply."""

    source: str
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: list[bool] = []
    write_ids: list[int] = []
    """Per block, the write id of its put (empty: none), kept with the copy."""


class CommandReply(Message, tag=53, frozen=True):
    done: list[bool]

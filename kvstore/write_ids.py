"""Write ids: which put wrote a block.

A put's client gives it an id (:func:`next_write_id`: 64 random bits), and every message of that
put carries it: its PutStart (the master keeps it with each key it reserves), its writes (each
daemon keeps it with the block and reports it in its inventory, so that a new leader adopting the
block knows it; a copy keeps it too), its PutEnd or its daemon's commit into a grant, its
PutRevoke. Whatever a fault does to the put's answers, the store can then say for certain whether
the block under a key is this put's: a PutEnd commits, and a PutRevoke gives up, only reservations
of its own write; a leader remembers the ids of the blocks it removed; a put that found its key
stored compares ids (another put of the same bytes is not its write).

0 is no id: a message that names none, a block read back from an arena after its daemon
restarted or held on SSD (daemons keep ids in memory only). Where either side has no id, a block
is judged by its bytes alone, as before ids: equal checksums of one key count as one write.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from kvstore.errors import InvalidArgument

NO_WRITE_ID = 0
MAX_WRITE_ID = 1 << 64
"""Write ids are u64 on the wire and in the tables."""


def next_write_id() -> int:
    """A new write id: 64 random bits (never 0), drawn from the system for each put, so that forked
    processes draw apart and no one can guess another put's id."""
    return secrets.randbits(64) or 1


def same_write(stored_id: int, stored_checksum: int, write_id: int, checksum: int) -> bool:
    """Whether a block stored with (``stored_id``, ``stored_checksum``) is the write (``write_id``,
    ``checksum``): equal checksums, and equal ids where both are known (a put writes one value a
    key: the same id with other bytes is not its write)."""
    return stored_checksum == checksum and (not stored_id or not write_id or stored_id == write_id)


def check_write_id(write_id: object, what: str = "write_id") -> int:
    """``write_id`` if it is a valid one (0 included), else :class:`InvalidArgument` naming it."""
    if type(write_id) is not int or not 0 <= write_id < MAX_WRITE_ID:
        raise InvalidArgument(f"{what} must be an int in [0, 2**64), got {write_id!r}")
    return write_id


def check_write_ids(write_ids: Sequence[int], count: int, what: str = "write_ids") -> list[int]:
    """Per block its write id: ``write_ids`` checked (one per block, each as :func:`check_write_id`
    wants it), or all 0 when none are given."""
    if not write_ids:
        return [NO_WRITE_ID] * count
    if len(write_ids) != count:
        raise InvalidArgument(f"{what} has {len(write_ids)} entries for {count} blocks")
    if not (set(map(type, write_ids)) == {int} and min(write_ids) >= 0 and max(write_ids) < MAX_WRITE_ID):
        for write_id in write_ids:
            check_write_id(write_id, what)
    return list(write_ids)

"""One-trip puts into granted space, across all three parties.

A client asks the master for a grant (:class:`GrantSpace`); the master opens it on the daemon
(:class:`OpenGrant`); the client writes blocks into it (:class:`WriteGranted`); the daemon has the
master commit them (:class:`CommitGranted`) and answers with a :class:`PutReply`. Grants end when
their time is up, when returned (:class:`ReturnGrants`) or when the master ends them
(:class:`EndGrants`).
"""

from __future__ import annotations

from kvstore.protocol.base import Message
from kvstore.results import PUT_EXISTS as PUT_EXISTS  # the commit codes the table answers, re-exported
from kvstore.results import PUT_STORED as PUT_STORED


class GrantSpace(Message, tag=70, frozen=True):
    """Ask for DRAM space to write into without a master round trip per put: ``length`` bytes of one
    node's arena (``preferred_node`` when it has room), held for this client until the grant's
    ``ttl_ms`` passes or it is returned. Answered by a GrantReply."""

    length: int
    preferred_node: str | None
    avoid: list[str] = []
    """As :attr:`PutStart.avoid`."""


class GrantReply(Message, tag=71, frozen=True):
    grant_id: int
    node_id: str
    address: str
    offset: int
    length: int
    ttl_ms: int
    """The grant ends this long after it was answered (the client stops using it a little before)."""
    alignment: int = 64
    """The node's extent alignment: blocks are carved from the grant at multiples of it."""


class OpenGrant(Message, tag=55, frozen=True):
    """Space of this daemon's arena the master granted a client: writes into it (WriteGranted) are
    taken until the grant ends, at the latest ``ttl_ms`` after this command arrived."""

    grant_id: int
    offset: int
    length: int
    ttl_ms: int
    owner: str = ""
    """The tenant the grant belongs to ("" without tenants): only its connections may write into it."""


class WriteGranted(Message, tag=67, frozen=True):
    """A put in one trip: write blocks into extents of a grant; the daemon checks them, has the
    master commit them, commits them here and answers with a PutReply. Bytes follow as in WriteBlocks.

    ``cached``: the daemon answers once the blocks are checked and committed in its arena, and has
    the master commit them after (batched with other puts' commits); :class:`FlushCommits` waits
    for that."""

    grant_id: int
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    cached: bool = False
    write_ids: list[int] = []
    """Per block, its put's write id (as in WriteBlocks)."""


class FlushCommits(Message, tag=68, frozen=True):
    """A client asks a daemon to answer (OkReply) once every ``cached`` put it acknowledged before
    this request is known to the master, or refused by it (then dropped here)."""


class CommitGranted(Message, tag=74, frozen=True):
    """A daemon asks the master to commit blocks written into a grant: each key becomes a block at
    its extent, or is refused (it exists, or its extent is not free in the grant). Answered by a
    PutReply."""

    node_id: str
    grant_id: int
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    cached: bool = False
    """The daemon answered these puts STORED already (cached puts): a key another put is still
    being written under is answered RetryLater, not EXISTS, until that put ends one way or the other."""
    write_ids: list[int] = []
    """Per block, the write id its writer gave (empty: none): the master keeps it with the block, and
    a block committed already answers PUT_STORED again to its own write only."""


# PUT_STORED, PUT_EXISTS (from the placement table): per-block codes of a one-trip put in :class:`PutReply`.


class PutReply(Message, tag=75, frozen=True):
    """Per block of a one-trip put: PUT_STORED, PUT_EXISTS (the stored bytes are kept), else the
    code of the error in :mod:`kvstore.errors` that refused it."""

    codes: list[int]
    errors: list[str]


class ReturnGrants(Message, tag=72, frozen=True):
    """Give granted space back early (its unused part returns to the pool)."""

    grant_ids: list[int]


class EndGrants(Message, tag=56, frozen=True):
    """Take no more writes into these grants and cut those in flight; answered once none can land."""

    grant_ids: list[int]

"""The read decisions without I/O: which replica of each block is read next, and what a daemon's
failure means for a read.

Both clients read the same way: a block is read from its first replica (a copy this client can
read locally first, when it has one); a replica that misses (evicted, a stale copy) or whose
daemon is gone or stalled is followed by the block's next replica; a block is a miss only when
every replica failed. A daemon that answers NotReady (its lease with the master lapsed: it may
not vouch for what it holds) is followed by the next replica too, but a block that no replica
served after one answered so fails the read with that error: it may well be stored there, so a
miss would be a lie. Any other error (a malformed reply, a buffer too small) fails the read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.errors import ConnectionFailed, NotReady, Timeout
from kvstore.protocol import LocatedRef, ReplicaRef

Place = tuple[str, str]
"""A node: (node_id, data-plane address)."""


def unreachable(outcome: object) -> bool:
    """Whether a daemon job's outcome says its node is gone or stalled: its blocks are read
    elsewhere (or are misses), never an error of the read."""
    return isinstance(outcome, ConnectionFailed | Timeout)


def refused(outcome: object) -> bool:
    """Whether a daemon job's outcome says its node may not serve now (NotReady): its blocks are
    read elsewhere, and a block with nowhere else to go fails the read with it."""
    return isinstance(outcome, NotReady)


def raise_failure(outcome: object) -> None:
    """Raise an outcome that is an error other than an unreachable or refusing node."""
    if isinstance(outcome, BaseException) and not unreachable(outcome) and not refused(outcome):
        raise outcome


class Failover:
    """Which replica each located block is read from, round by round.

    Invariants: each block is in exactly one state — waiting for its current replica, read, or
    missed after its last replica; a block advances only through :meth:`missed`, one replica at a
    time, in the order fixed at construction (``local`` replicas first, then the master's order,
    which lists DRAM first). Only the caller that drives the rounds changes it.
    """

    def __init__(self, blocks: dict[int, LocatedRef], local: Callable[[ReplicaRef], bool] | None = None) -> None:
        self._order: dict[int, list[ReplicaRef]] = {}
        for i, loc in blocks.items():
            replicas = list(loc.replicas)
            if local is not None:
                replicas.sort(key=lambda r: not local(r))  # stable: the master's order otherwise
            if replicas:
                self._order[i] = replicas
        self._at = dict.fromkeys(self._order, 0)
        self._deferred: set[tuple[int, str]] = set()
        """(block, node) put off to the end of the block's order once (see :meth:`defer`)."""
        self.not_held: dict[int, set[str]] = {}
        """Per block, the nodes that answered they do not hold it (see :meth:`doubted`; empty: no block is)."""
        self.read: set[int] = set()
        self._refusals: dict[int, NotReady] = {}
        """Per block, a replica's refusal (see :func:`refused`): raised if no later replica serves it."""

    def round(self) -> dict[Place, list[tuple[int, ReplicaRef]]]:
        """Per node, the blocks to read from it now and the replica of each (empty when done)."""
        out: dict[Place, list[tuple[int, ReplicaRef]]] = {}
        for i, at in self._at.items():
            replica = self._order[i][at]
            out.setdefault((replica.node_id, replica.address), []).append((i, replica))
        return out

    def has_next(self, i: int) -> bool:
        """Whether block ``i`` has a replica after its current one."""
        return self._at[i] + 1 < len(self._order[i])

    def onward(self, group: list[tuple[int, ReplicaRef]]) -> list[tuple[int, ReplicaRef]]:
        """The blocks of ``group`` (a node's share of a :meth:`round`) that have a replica after their
        current one (``group`` itself when all do; empty when every one is a last copy)."""
        at, order = self._at, self._order
        out = [(i, r) for i, r in group if at[i] + 1 < len(order[i])]
        return group if len(out) == len(group) else out

    def later(self, i: int) -> list[str]:
        """The nodes of block ``i``'s replicas after its current one."""
        return [r.node_id for r in self._order[i][self._at[i] + 1 :]]

    def doubted(self, i: int) -> bool:
        """Whether block ``i``'s current replica is its last and another replica's node answered
        that it does not hold the block: the key may have been removed (or put again, or moved)
        since the master located it, or that node alone lost its copy (evicted there, drained)."""
        order, at = self._order[i], self._at[i]
        return at + 1 == len(order) and bool(self.not_held.get(i, set()) - {order[at].node_id})

    def relocate(self, i: int, replicas: Sequence[ReplicaRef]) -> None:
        """Block ``i``'s replicas from its current one on are ``replicas`` now (the master's answer
        when asked again), less those of nodes that answered they do not hold it; none left: missed."""
        order, at = self._order[i], self._at[i]
        gone = self.not_held.get(i, set())
        rest = [r for r in replicas if r.node_id not in gone]
        if not rest:
            del self._at[i]
            return
        self._order[i] = order[:at] + rest

    def waiting(self, i: int) -> bool:
        """Whether block ``i`` is still to be read (neither read nor missed after its last replica)."""
        return i in self._at

    def current(self, i: int) -> ReplicaRef:
        """Block ``i``'s replica read next."""
        return self._order[i][self._at[i]]

    def done(self, i: int) -> None:
        """Block ``i`` was read."""
        del self._at[i]
        self.read.add(i)

    def missed(self, i: int) -> None:
        """Block ``i``'s current replica did not serve it: its next replica, if any, is read next round."""
        at = self._at[i] + 1
        if at < len(self._order[i]):
            self._at[i] = at
        else:
            del self._at[i]

    def defer(self, i: int) -> None:
        """Block ``i``'s current replica is on a node that is alive but slow now (a read gave it up
        at its patience, or it is marked slow): read the block's next replicas first and this one
        again last, once. (Missing it for good made a stored block a miss when the replicas after
        it were dead or gone.) A replica deferred before, or the last one, is :meth:`missed`."""
        order, at = self._order[i], self._at[i]
        replica = order[at]
        if at + 1 >= len(order) or (i, replica.node_id) in self._deferred:
            self.missed(i)
            return
        self._deferred.add((i, replica.node_id))
        order.append(replica)
        self._at[i] = at + 1

    def take(
        self, group: Sequence[tuple[int, ReplicaRef]], outcome: object, ok: Callable[[int, object], bool],
        gave_up: bool = False,
    ) -> None:  # fmt: skip
        """Note a node's answer for ``group``: an unreachable node misses them all (``gave_up``: the
        read gave it up at its patience, a Timeout: it is alive, its blocks are :meth:`defer`-red);
        otherwise ``ok(i, per_block_result)`` tells a hit. Raises an outcome that is another error."""
        if isinstance(outcome, BaseException):
            raise_failure(outcome)
            if gave_up and isinstance(outcome, Timeout):
                for i, _ in group:
                    self.defer(i)
                return
            for i, _ in group:  # unreachable, or refused
                if isinstance(outcome, NotReady):
                    self._refusals[i] = outcome
                self.missed(i)
            return
        answers: Sequence[object] = outcome  # type: ignore[assignment]  # per block (no cast: a call per read)
        for (i, replica), got in zip(group, answers, strict=True):
            if ok(i, got):
                self.done(i)
            else:
                self.not_held.setdefault(i, set()).add(replica.node_id)
                self.missed(i)

    def finish(self) -> None:
        """Once every round is done: raise a refusal that left a block unread, if one did."""
        for i, refusal in self._refusals.items():
            if i not in self.read:
                raise refusal

    def __bool__(self) -> bool:
        return bool(self._at)

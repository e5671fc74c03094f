"""The put protocols' decisions without I/O, used by :class:`~kvstore_client.core.ClientCore`:
checking a put's items, sorting the master's tickets, reading the daemons' and the master's
answers into statuses and the first failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.buffers import as_view
from kvstore.errors import (
    ConnectionFailed,
    GrantExpired,
    InvalidArgument,
    KVStoreError,
    ProtocolError,
    QuotaExceeded,
    RetryLater,
    Timeout,
    error_from_code,
)
from kvstore.keys import BlockKey, validate_key
from kvstore.protocol import PUT_EXISTS, PUT_STORED, PutStartReply, Replica
from kvstore.results import PutStatus

Items = list[tuple[BlockKey, memoryview]]
Place = tuple[str, str]
"""A block's node: (node_id, data-plane address)."""

_TWO_TRIP = frozenset({GrantExpired.code, RetryLater.code, ConnectionFailed.code, Timeout.code, QuotaExceeded.code})
"""Codes of a one-trip put that send the block the two-trip way instead of failing the put (over its
tenant's quota: that way the master evicts the tenant's own blocks for it, or refuses it)."""

_AGAIN = frozenset({RetryLater.code, ConnectionFailed.code, Timeout.code})
"""Codes of a two-trip write that put the block again (see :func:`take_write_codes`)."""


@dataclass(frozen=True, slots=True)
class PutOptions:
    replicas: int | None = None
    """Copies on distinct nodes; None takes ``ClientConfig.replicas``."""
    pin: bool = False
    """Never evict the block (until it is removed)."""
    preferred_node: str | None = None
    """Node to place the first replica on when it has room (local-first placement)."""
    mode: str | None = None
    """When the put returns STORED: "visible" or "cached" (see ``ClientConfig.put_mode``); None takes
    the client's ``put_mode``."""

    def __post_init__(self) -> None:
        if self.replicas is not None and (type(self.replicas) is not int or not 1 <= self.replicas <= 16):
            raise InvalidArgument(f"replicas must be an int from 1 to 16 (or None), got {self.replicas!r}")
        if type(self.pin) is not bool:
            raise InvalidArgument(f"pin must be a bool, got {self.pin!r}")
        if self.mode not in (None, "visible", "cached"):
            raise InvalidArgument(f'mode must be "visible", "cached" or None, got {self.mode!r}')
        if self.preferred_node is not None and not isinstance(self.preferred_node, str):
            raise InvalidArgument(f"preferred_node must be a node id (str) or None, got {self.preferred_node!r}")


def checked_options(options: Any) -> PutOptions:
    if options is not None and not isinstance(options, PutOptions):
        raise InvalidArgument(f"options must be PutOptions, got {type(options).__name__}")
    return options or PutOptions()


def checked_pairs(items: Iterable[Any]) -> Items:
    """Checked (key, bytes) pairs of a put: each item must be a (key, data) pair of a non-empty block."""
    out = []
    for n, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidArgument(f"put item {n} must be a (key, data) pair, got {type(item).__name__} {item!r:.60}")
        key = validate_key(item[0])
        view = as_view(item[1])
        if view.nbytes == 0:
            raise InvalidArgument(f"block {key!r} is empty; blocks must hold at least one byte")
        out.append((key, view))
    return out


@dataclass(slots=True)
class Placement:
    """A PutStart answer, sorted out: what to write where, what to ask again, what failed."""

    retry: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    """Written, but the master no longer knew the reservation at PutEnd: revoked, then put again."""
    writes: dict[str, list[tuple[int, Replica]]] = field(default_factory=dict)
    """Per daemon address, the blocks (by index) and the replica to write each into."""
    placed: dict[int, Place] = field(default_factory=dict)
    failure: KVStoreError | None = None
    unreached: KVStoreError | None = None
    """A daemon's failure to take writes that are put again (not reached, no answer): raised when the
    retries run out."""

    def fail(self, error: KVStoreError) -> None:
        """Keep the first failure."""
        self.failure = self.failure or error


def sort_tickets(reply: PutStartReply, todo: Sequence[int], out: list[PutStatus | None]) -> Placement:
    tickets = reply.tickets()
    if len(tickets) != len(todo):
        raise ProtocolError(f"the master answered {len(tickets)} tickets for {len(todo)} keys")
    plan = Placement()
    for i, ticket in zip(todo, tickets, strict=True):
        if ticket.status == "exists":
            out[i] = PutStatus.EXISTS
        elif ticket.status == "error":
            if ticket.error_code == RetryLater.code:
                plan.retry.append(i)
            else:
                plan.fail(error_from_code(ticket.error_code, ticket.error))
        else:
            for replica in ticket.replicas:
                plan.writes.setdefault(replica.address, []).append((i, replica))
            if ticket.replicas:
                plan.placed[i] = (ticket.replicas[0].node_id, ticket.replicas[0].address)
    return plan


def take_write_codes(
    plan: Placement, items: Items, address: str, group: Sequence[tuple[int, Replica]],
    codes: Sequence[tuple[int, str]], failed: set[int],
) -> None:  # fmt: skip
    """Note the blocks a daemon refused (into ``failed``, the first as the plan's failure). One
    refused for RetryLater (another block, which the daemon is dropping, holds its key or extent),
    or whose daemon was not reached or did not answer (the master fences a silent node within its
    TTL and places elsewhere), is revoked and put again."""
    for (i, _), (code, text) in zip(group, codes, strict=True):
        if code:
            failed.add(i)
            if code in _AGAIN:
                if i not in plan.retry:
                    plan.retry.append(i)
                if code != RetryLater.code:
                    plan.unreached = plan.unreached or error_from_code(
                        code, f"writing {items[i][0]!r} to {address}: {text}"
                    )
            else:
                plan.fail(error_from_code(code, f"writing {items[i][0]!r} to {address}: {text}"))


def take_commits(
    plan: Placement, items: Items, done: Sequence[int], committed: Sequence[bool], out: list[PutStatus | None]
) -> list[tuple[str, Place | None]]:
    """Statuses from a PutEnd answer; returns where the stored blocks are (for location hints)."""
    if len(committed) != len(done):
        raise ProtocolError(f"the master answered {len(committed)} commits for {len(done)} keys")
    stored: list[tuple[str, Place | None]] = []
    for i, ok in zip(done, committed, strict=True):
        if ok:
            out[i] = PutStatus.STORED
            if i in plan.placed:
                stored.append((items[i][0], plan.placed[i]))
        else:
            plan.lost.append(i)  # reserved by a master that has since gone, or expired: put again
    return stored


def take_granted(
    items: Items, todo: Sequence[int], codes: Sequence[tuple[int, str]], node_id: str, address: str,
    out: list[PutStatus | None],
) -> tuple[list[int], list[tuple[str, Place | None]]]:  # fmt: skip
    """Statuses from a one-trip put's answer; returns the blocks left to the two-trip way and where
    the stored ones are. Raises the first error that is not one of those."""
    left: list[int] = []
    failure: KVStoreError | None = None
    placed: list[tuple[str, Place | None]] = []
    for i, (code, text) in zip(todo, codes, strict=True):
        if code == PUT_STORED:
            out[i] = PutStatus.STORED
            placed.append((items[i][0], (node_id, address)))
        elif code == PUT_EXISTS:
            out[i] = PutStatus.EXISTS
        elif code in _TWO_TRIP:
            left.append(i)
        else:
            failure = failure or error_from_code(code, f"writing {items[i][0]!r} to {address}: {text}")
    if failure is not None:
        raise failure
    return left, placed


def write_codes(codes: Sequence[int], errors: Sequence[str], n: int, address: str) -> list[tuple[int, str]]:
    """A WriteReply's or PutReply's per-block (code, text), checked to answer ``n`` blocks."""
    if not len(codes) == len(errors) == n:
        raise ProtocolError(f"{address} answered {len(codes)} results for {n} writes")
    return list(zip(codes, errors, strict=True))

"""What the client core asks its driver to do: the I/O of an operation, as values.

An operation of :class:`~kvstore_client.core.ClientCore` is a generator that yields these
effects and is sent each one's result; the blocking face (:class:`~kvstore_client.store.Store`)
carries them out with sockets and threads, the asyncio face
(:class:`~kvstore_client.aio.AsyncStore`) on the event loop. So the decisions (what to send,
which replica next, what an answer means) are written once, and neither face can drift.

Results: a :class:`Call` is answered by its reply (or its error thrown into the operation); a
:class:`Daemons` by one outcome per job, its result or the exception it raised (a dead node is
an answer to weigh, not a failure of the whole operation); :class:`Notify` and :class:`Pause`
by None.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from kvstore.protocol import (
    CommitBlocks,
    LocatedRef,
    Message,
    ReadBlocks,
    ReadSlices,
    ReplicaRef,
    WriteBlocks,
    WriteGranted,
)

R = TypeVar("R", bound=Message)
T = TypeVar("T")

Located = tuple[LocatedRef, ReplicaRef, memoryview]
"""A block the master located, the replica to read, and the buffer to read it into."""


class Direct(NamedTuple):
    """A block a daemon served by key: its size and checksum."""

    size: int
    checksum: int


class Block(NamedTuple):
    """A block to write: key, bytes, the extent offset to write it at, its checksum."""

    key: str
    view: memoryview
    offset: int
    checksum: int
    seal: bytes = b""
    """The master's seal of the extent (a tenant's two-trip put); empty otherwise."""
    write_id: int = 0
    """Its put's write id (:mod:`kvstore.write_ids`), kept with the block by its daemon."""


@dataclass(frozen=True, slots=True)
class Call(Generic[R]):
    """A request to the master, retried through its restarts and failovers (up to the timeout)."""

    message: Message
    expect: type[R]


@dataclass(frozen=True, slots=True)
class Notify:
    """A best-effort message to the master (returned grants, released leases): its failure is ignored,
    since what it ends also ends by itself."""

    message: Message


@dataclass(frozen=True, slots=True)
class Pause:
    seconds: float


@dataclass(frozen=True, slots=True)
class ReadLocated:
    """Read located blocks from one replica each; result: per block its size, None for a miss (a
    block of another size than the master described is a stale copy: a miss)."""

    node_id: str
    address: str
    blocks: list[Located]
    patience_s: float = 0.0
    """Give the read up (a Timeout) when the daemon has not begun answering within this: every
    block has another replica to go to. 0: the client's timeout."""


@dataclass(frozen=True, slots=True)
class ReadDirect:
    """Read blocks by key alone, in one round trip; result: ``(list[Direct | None], made)``, where a
    None view gets a new buffer (``made[i]``, any bytes-like). A block larger than its view, or of
    another size with ``exact_size``, is a miss."""

    node_id: str
    address: str
    keys: list[str]
    views: Sequence[memoryview | None]
    exact_size: bool
    patience_s: float = 0.0
    """As :attr:`ReadLocated.patience_s` (the master's way is the fallback)."""


@dataclass(frozen=True, slots=True)
class ReadRanges:
    """Read bytes ``[start, start + length)`` of located blocks into their buffers (each exactly
    ``length`` long); result: per block True when read."""

    node_id: str
    address: str
    blocks: list[Located]
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class WriteReserved:
    """Write blocks into extents the master reserved; result: per block (0, "") or (code, text)."""

    node_id: str
    address: str
    blocks: list[Block]
    pinned: bool
    patience_s: float = 0.0
    """A Timeout when the daemon has not begun answering within it (0: the whole timeout)."""


@dataclass(frozen=True, slots=True)
class PutGranted:
    """A one-trip put into a grant; result: per block (PUT_STORED | PUT_EXISTS | error code, text)."""

    node_id: str
    address: str
    grant_id: int
    blocks: list[Block]
    pinned: bool
    cached: bool = False
    """Acknowledged once in the daemon's arena, the master told after (``PutOptions.mode``)."""


@dataclass(frozen=True, slots=True)
class FlushCached:
    """Wait until the node has told the master of every cached put it acknowledged; result None."""

    node_id: str
    address: str


Job = ReadLocated | ReadDirect | ReadRanges | WriteReserved | PutGranted | FlushCached


@dataclass(frozen=True, slots=True)
class Daemons:
    """Jobs for daemons, run in parallel: one outcome per job, in order."""

    jobs: Sequence[Job]


Effect = Call[Any] | Notify | Pause | Daemons
Op = Generator[Effect, Any, T]
"""An operation: yields effects, returns its answer."""


def drive(op: Op[T], answer: Callable[[Effect], Any]) -> T:
    """Carry out ``op``'s effects in turn, each by ``answer``, until it returns; an effect's error
    (any, cancellation too) is thrown into the operation, whose cleanup runs and which decides.
    The blocking face's loop; the asyncio face's is this one with ``await answer(effect)``."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = op.throw(error) if error is not None else op.send(value)
        except StopIteration as stop:
            result: T = stop.value
            return result
        value, error = None, None
        try:
            value = answer(effect)
        except BaseException as exc:  # into the operation: its cleanup runs, then it decides
            error = exc


def call(message: Message, expect: type[R]) -> Op[R]:
    """A master call inside an operation (``reply = yield from call(...)``), typed by its reply."""
    reply: R = yield Call(message, expect)
    return reply


def daemons(jobs: Sequence[Job]) -> Op[list[Any]]:
    """Run ``jobs``; per job its result or its exception."""
    if not jobs:
        return []
    outcomes: list[Any] = yield Daemons(jobs)
    return outcomes


# -- the messages a data path sends for a job, built once for every transport -------------------------
def read_message(blocks: Sequence[Located]) -> ReadBlocks:
    return ReadBlocks(
        [loc.key for loc, _, _ in blocks], [r.tier for _, r, _ in blocks], [r.offset for _, r, _ in blocks],
        [loc.size for loc, _, _ in blocks],
    )  # fmt: skip


def read_by_key_message(keys: Sequence[str]) -> ReadBlocks:
    """A read by key alone: the daemon finds each block in its own index."""
    return ReadBlocks(list(keys), ["dram"] * len(keys), [0] * len(keys), [0] * len(keys))


def ranges_message(keys: Sequence[str], start: int, length: int) -> ReadSlices:
    return ReadSlices(list(keys), [start] * len(keys), [length] * len(keys))


def _columns(blocks: Sequence[Block]) -> tuple[list[str], list[int], list[int], list[int]]:
    """The keys, offsets, sizes and checksums of ``blocks``, as a write message carries them."""
    return (
        [b.key for b in blocks],
        [b.offset for b in blocks],
        [b.view.nbytes for b in blocks],
        [b.checksum for b in blocks],
    )


def seals(blocks: Sequence[Block]) -> list[bytes]:
    """The seals of ``blocks`` as a write message carries them: none when none is sealed."""
    return [b.seal for b in blocks] if any(b.seal for b in blocks) else []


def write_ids(blocks: Sequence[Block]) -> list[int]:
    """The write ids of ``blocks`` as a write message carries them: none when none has one."""
    return [b.write_id for b in blocks] if any(b.write_id for b in blocks) else []


def write_message(blocks: Sequence[Block], pinned: bool) -> WriteBlocks:
    return WriteBlocks(*_columns(blocks), pinned, seals(blocks), write_ids(blocks))


def commit_message(blocks: Sequence[Block], pinned: bool) -> CommitBlocks:
    """Commit blocks already copied into their extents (through shared memory)."""
    return CommitBlocks(*_columns(blocks), pinned, seals(blocks), write_ids(blocks))


def granted_message(grant_id: int, blocks: Sequence[Block], pinned: bool, cached: bool = False) -> WriteGranted:
    return WriteGranted(grant_id, *_columns(blocks), pinned, cached, write_ids(blocks))

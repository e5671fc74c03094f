"""A daemon's tiers under a readers-writer lock, with the operations the network asks for.

The master places blocks (it owns the arena's allocator), so the arena runs
unmanaged. Commits, moves between tiers, drops and crash recovery are the
:class:`kvstore.tiers.engine.TierEngine`'s, the same as an embedded NodeStore's;
this class adds the checks a write from the network needs and the locking.

Readers hold the shared lock while their bytes go out, so that no command
frees an extent that is being sent; commands and the short steps of a write
take it exclusively.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

from kvstore.allocator import align_up
from kvstore.config import DramConfig, SsdConfig
from kvstore.errors import CorruptBlock, InvalidArgument, KVStoreError, NotReady, RetryLater
from kvstore.keys import BlockKey, checksum
from kvstore.protocol import InventoryItem
from kvstore.tiers.engine import TierEngine
from kvstore.write_ids import check_write_ids


class BlockState(NamedTuple):
    """A block as a daemon holds it (what an orphan check asks the master about)."""

    offset: int
    """Its DRAM offset; -1 on SSD."""
    size: int
    checksum: int
    """-1 while it is being written."""


MAX_FENCES = 65_536
"""Copies a daemon remembers as given up (see :meth:`DaemonStorage.drop`)."""
MAX_UNCONFIRMED = 1 << 20
"""Two-trip blocks awaiting the master's word at most (see ``DaemonStorage._unconfirmed``): beyond,
the oldest are served by key as before (the orphan sweep is their only check then)."""


class RWLock:
    """Many readers or one writer; writers wait for readers to finish. ``shared()`` and
    ``exclusive()`` hand out the same two context objects every time (every read and write of the
    daemon takes one: they cost two lock round trips, no generator and no notify nobody waits for)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._readers = 0
        self._writer = False
        self._waiting = 0
        self._shared = _Shared(self)
        self._exclusive = _Exclusive(self)

    def shared(self) -> _Shared:
        return self._shared

    def exclusive(self) -> _Exclusive:
        return self._exclusive

    def _wait(self, ready: Callable[[], bool]) -> None:
        """(Holding the lock) until ``ready()``."""
        self._waiting += 1
        try:
            self._cond.wait_for(ready)
        finally:
            self._waiting -= 1


class _Shared:
    __slots__ = ("_rw",)

    def __init__(self, rw: RWLock) -> None:
        self._rw = rw

    def __enter__(self) -> None:
        rw = self._rw
        with rw._lock:
            if rw._writer:
                rw._wait(lambda: not rw._writer)
            rw._readers += 1

    def __exit__(self, *exc: object) -> None:
        rw = self._rw
        with rw._lock:
            rw._readers -= 1
            if rw._waiting and not rw._readers:
                rw._cond.notify_all()


class _Exclusive:
    __slots__ = ("_rw",)

    def __init__(self, rw: RWLock) -> None:
        self._rw = rw

    def __enter__(self) -> None:
        rw = self._rw
        with rw._lock:
            if rw._writer or rw._readers:
                rw._wait(lambda: not rw._writer and rw._readers == 0)
            rw._writer = True

    def __exit__(self, *exc: object) -> None:
        rw = self._rw
        with rw._lock:
            rw._writer = False
            if rw._waiting:
                rw._cond.notify_all()


class WriteBatch:
    """A batch of block writes in flight: reserved extents to fill, then checked and committed together.

    ``targets`` has one buffer per block, in order: its reserved extent, or an empty view for a
    block refused (its error is reported) or already stored exactly so (a retried write: success);
    the bytes of those are received into scratch (:func:`transfer.wire.recv_parts`), never
    into a buffer of the size the sender named.
    """

    def __init__(
        self,
        storage: DaemonStorage,
        keys: Sequence[BlockKey],
        offsets: Sequence[int],
        sizes: Sequence[int],
        checksums: Sequence[int],
        pinned: bool | Sequence[bool],
        join: bool = False,
        fenced: bool = False,
        confirmed: bool = True,
        write_ids: Sequence[int] = (),
    ) -> None:
        """``pinned``: for every block, or per block (a drain's copies: each as its source holds it).
        ``confirmed``: False for a two-trip put's blocks (see :meth:`DaemonStorage.write_batch`).
        ``write_ids``: per block, its put's write id, kept with it (none: not known)."""
        if not len(offsets) == len(sizes) == len(checksums) == len(keys) or any(s <= 0 for s in sizes):
            raise InvalidArgument("a write batch with mismatched or non-positive sizes")
        self._write_ids = check_write_ids(write_ids, len(keys))
        self._storage = storage
        self._keys, self._checksums = list(keys), list(checksums)
        self._pinned = [pinned] * len(keys) if isinstance(pinned, bool) else list(pinned)
        if len(self._pinned) != len(keys):
            raise InvalidArgument(f"a write batch of {len(keys)} blocks with {len(self._pinned)} pins")
        self._reserved = storage.begin_writes(
            list(zip(keys, offsets, sizes, strict=True)), checksums, join=join, fenced=fenced
        )
        self.targets = [r if isinstance(r, memoryview) else NO_TARGET for r in self._reserved]
        self._open = True
        self._confirmed = confirmed

    def abort(self) -> None:
        """Give every reserved extent back (the bytes never all arrived)."""
        if self._open:
            self._open = False
            self._storage.abort_writes(
                [(k, r) for k, r in zip(self._keys, self._reserved, strict=True) if isinstance(r, memoryview)]
            )

    def verify(self, sums: Sequence[int | None] = ()) -> list[bool]:
        """Per block, whether its bytes arrived whole and match the writer's checksum (blocks already
        stored exactly so count as verified; refused ones do not). Outside any lock. ``sums``: the
        checksums of the targets, computed as they were received (:func:`transfer.wire.recv_parts`)."""
        given = list(sums) or [None] * len(self._reserved)
        self._sums = [
            (checksum(r) if s is None else s) if isinstance(r, memoryview) else None
            for r, s in zip(self._reserved, given, strict=True)
        ]
        return [
            (s == c) if isinstance(r, memoryview) else r is None
            for r, s, c in zip(self._reserved, self._sums, self._checksums, strict=True)
        ]

    def finish(self, accept: Sequence[bool] | None = None) -> list[KVStoreError | None]:
        """Commit the blocks whose bytes match their checksums (and that ``accept`` allows; the others
        are discarded); per block None or the error that refused it."""
        self._open = False
        sums = getattr(self, "_sums", None)
        done = iter(
            self._storage.finish_writes(
                [
                    (k, r, c)
                    for k, r, c in zip(self._keys, self._reserved, self._checksums, strict=True)
                    if isinstance(r, memoryview)
                ],
                [p for p, r in zip(self._pinned, self._reserved, strict=True) if isinstance(r, memoryview)],
                write_ids=[
                    w for w, r in zip(self._write_ids, self._reserved, strict=True) if isinstance(r, memoryview)
                ],
                sums=[s for s, r in zip(sums, self._reserved, strict=True) if isinstance(r, memoryview)]
                if sums is not None
                else None,
                accept=[a for a, r in zip(accept, self._reserved, strict=True) if isinstance(r, memoryview)]
                if accept is not None
                else None,
                confirmed=self._confirmed,
            )
        )
        return [next(done) if isinstance(r, memoryview) else r for r in self._reserved]


NO_TARGET = memoryview(b"")
"""The target of a block whose bytes are not kept (refused, or stored already): received into scratch."""


def _always(wait_s: float = 0.0) -> bool:
    return True


class DaemonStorage:
    def __init__(self, dram: DramConfig, ssd: SsdConfig) -> None:
        self.engine = TierEngine(dram, ssd, managed=False)
        self.arena = self.engine.arena
        self.ssd = self.engine.ssd
        self.lock = RWLock()
        self._fences: OrderedDict[tuple[BlockKey, int], None] = OrderedDict()
        """Copies the master gave up on before they arrived: (key, offset) a fetch must not commit.
        At most ``MAX_FENCES``, oldest forgotten first (a copy is fetched within seconds of its
        command, or never)."""
        self.on_conflict: Callable[[list[tuple[BlockKey, int, int]]], None] | None = None
        """Called with the (key, offset, size) of writes refused because another block holds the key or
        overlaps the extent (an orphan, most likely: see :class:`server.daemon.orphans.Orphans`)."""
        self._watch: set[BlockKey] | None = None
        """While an orphan check is in flight: the keys whose writes began meanwhile (not its to drop)."""
        self._registering = False
        self._unconfirmed: OrderedDict[BlockKey, tuple[int, int]] = OrderedDict()
        """Blocks two-trip puts wrote here that the master has not vouched for: (DRAM offset, checksum).
        The put commits at the master after its bytes land, and may never (its reservation given up:
        an orphan), so such a block is served only to a reader the master sent (a located read,
        which confirms it when it names its extent), never to one that came by key alone (a hint:
        the reader asks the master instead). An orphan check the master answers "known", and a
        registration (the master adopted what it did not drop), confirm too. At most
        ``MAX_UNCONFIRMED``; an entry for a block since dropped or rewritten is stale, and
        forgotten when met."""
        self.serving: Callable[[float], bool] = _always
        """Whether blocks may be served by key now, waiting up to the given seconds for it (the master
        link's serve lease, see :meth:`server.daemon.master_link.MasterLink.serving`): reads raise
        NotReady while it is False."""
        self.serving_by_key: Callable[[], bool] = lambda: True
        """Whether blocks may be served to readers by key alone now (the master link's lease for
        them, see :meth:`server.daemon.master_link.MasterLink.serving_by_key`): such reads raise
        NotReady while it is False (the reader asks the master)."""

    def ssd_health(self) -> tuple[int, int, str]:
        """The SSD tier's capacity now (checked against its disk's free space), its configured one and
        why they differ; (-1, -1, "") without one."""
        if self.ssd is None:
            return -1, -1, ""
        # Without the storage lock: a heartbeat must not wait behind a demotion to a slow disk.
        return self.ssd.refresh_capacity(), self.ssd.config.capacity, self.ssd.fault

    @contextmanager
    def registering(self) -> Iterator[None]:
        """While this node registers: from before its inventory is taken until the master answered.
        The master adopts what the inventory says. A block dropped, demoted or promoted after the
        inventory was taken (the master confirmed the command before it read the inventory) would
        come back there: a removed key in the table again, an extent believed taken whose bytes are
        gone (shared-memory readers copy what lies there, writers write over live blocks). A block
        committed after it would be one the master does not know, in space it hands out. Meanwhile
        those changes are refused: commands with NotReady (the master keeps them pending; its answer
        to the registration says what to drop), writes with RetryLater (the writer puts again)."""
        with self.lock.exclusive():
            self._registering = True
        try:
            yield
        finally:
            with self.lock.exclusive():
                self._registering = False

    def drop_unadopted(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> None:
        """Drop the blocks a registration's answer names (the master did not adopt them; per key its
        tier, or "" for wherever it is), within that registration: before this node serves again."""
        with self.lock.exclusive():
            for tier in sorted(set(tiers)):
                self.engine.drop([k for k, t in zip(keys, tiers, strict=True) if t == tier], tier)
            self._unconfirmed.clear()  # the master adopted every block it did not name

    def _refuse_while_registering(self) -> None:
        """Under the lock: NotReady while a registration is under way (see :meth:`registering`)."""
        if self._registering:
            raise NotReady("this node is registering with a master: it changes its blocks once answered")

    def inventory(self) -> list[InventoryItem]:
        """Everything held, oldest use first, as the master rebuilds its table from it."""
        with self.lock.shared():
            extent = self.arena.extent
            dram = [
                (e.seq, InventoryItem(e.key, "dram", extent(e.key).offset, e.size, e.checksum, e.pinned, e.write_id))
                for e in self.arena.entries()
            ]
            ssd = [
                (e.seq, InventoryItem(e.key, "ssd", -1, e.size, e.checksum, e.pinned))
                for e in (self.ssd.entries() if self.ssd else [])
            ]
        return [item for _, item in sorted(dram + ssd, key=lambda p: p[0])]

    # -- writes ------------------------------------------------------------------
    def slice_views(self, slices: Sequence[tuple[BlockKey, int, int, int, int]]) -> list[memoryview | KVStoreError]:
        """For each (key, offset, size, start, length): a writable view of that range of the block,
        reserving the block at its first slice; or the error that refused it."""
        out: list[memoryview | KVStoreError] = []
        views = self.begin_writes([(k, o, s) for k, o, s, _, _ in slices], join=True)
        for (key, _, size, start, length), view in zip(slices, views, strict=True):
            if isinstance(view, KVStoreError):
                out.append(view)
            elif view is None or not (start >= 0 and 0 < length <= size - start):
                out.append(InvalidArgument(f"slice ({start}, {length}) of block {key!r} of {size} bytes"))
            else:
                out.append(view[start : start + length])
        return out

    def write_batch(
        self,
        keys: Sequence[BlockKey],
        offsets: Sequence[int],
        sizes: Sequence[int],
        checksums: Sequence[int],
        pinned: bool | Sequence[bool] = False,
        join: bool = False,
        fenced: bool = False,
        confirmed: bool = True,
        write_ids: Sequence[int] = (),
    ) -> WriteBatch:
        """``join``: a block already being written at the same extent (by WriteSlices) is committed as it is.
        ``fenced``: a copy from another daemon, refused where a drop fenced it off (see :meth:`drop`).
        ``confirmed``: False for a two-trip put's blocks, which the master learns of only after
        (see ``_unconfirmed``); a grant's, a copy's are the master's already. ``write_ids``: per
        block its put's write id (:mod:`kvstore.write_ids`), kept with it and in the inventory;
        InvalidArgument when they do not fit the blocks."""
        return WriteBatch(self, keys, offsets, sizes, checksums, pinned, join, fenced, confirmed, write_ids)

    def begin_writes(
        self,
        blocks: Sequence[tuple[BlockKey, int, int]],
        checksums: Sequence[int] | None = None,
        join: bool = False,
        fenced: bool = False,
    ) -> list[memoryview | KVStoreError | None]:
        """Reserve each (key, offset, size) in the arena: a writable view, or the error that refused it.

        With ``checksums``: None for a block already stored exactly so (a retried write whose
        first answer was lost), which needs no bytes. With ``join``: a block already being
        written at the same extent gives its view again (the slices of one block)."""
        out: list[memoryview | KVStoreError | None] = []
        conflicts: list[tuple[BlockKey, int, int]] = []
        with self.lock.exclusive():
            watch = self._watch
            for i, (key, offset, size) in enumerate(blocks):
                if watch is not None:
                    watch.add(key)  # written anew while an orphan check is out: not the orphan asked about
                if fenced and self._fences.pop((key, offset), False) is None:
                    out.append(
                        InvalidArgument(f"the copy of block {key!r} into {offset} was dropped before it arrived")
                    )
                    continue
                if join and self.arena.is_pending(key):
                    view = self.arena.pending_view(key, offset, size)
                    out.append(view if view is not None else InvalidArgument(
                        f"block {key!r} is being written at another extent"))  # fmt: skip
                    continue
                if checksums is not None and key in self.arena:
                    entry = self.arena.entry(key)
                    if (self.arena.extent(key).offset, entry.size, entry.checksum) == (offset, size, checksums[i]):
                        out.append(None)
                        continue
                try:
                    out.append(self.arena.begin_at(key, offset, size))
                except RetryLater as exc:
                    out.append(exc)
                    conflicts.append((key, offset, size))
                except KVStoreError as exc:
                    out.append(exc)
        if conflicts and self.on_conflict is not None:
            self.on_conflict(conflicts)
        return out

    def finish_writes(
        self,
        blocks: Sequence[tuple[BlockKey, memoryview, int]],
        pinned: bool | Sequence[bool] = False,
        sums: Sequence[int | None] | None = None,
        accept: Sequence[bool] | None = None,
        confirmed: bool = True,
        write_ids: Sequence[int] = (),
    ) -> list[KVStoreError | None]:
        """Commit blocks whose bytes are in their views and match their checksums; discard the others
        (and those ``accept`` refuses: reported as None, their fate told by whoever refused them).
        ``sums``: the checksums of the views, computed already. ``confirmed``: see :meth:`write_batch`."""
        if sums is None:
            sums = [checksum(view) for _, view, _ in blocks]  # outside the lock: readers go on meanwhile
        pins = [pinned] * len(blocks) if isinstance(pinned, bool) else pinned
        ids = write_ids or [0] * len(blocks)
        out: list[KVStoreError | None] = []
        with self.lock.exclusive():
            for i, ((key, view, expected), actual) in enumerate(zip(blocks, sums, strict=True)):
                view.release()
                if self._registering:  # see registering(): put again once the master has the inventory
                    self.engine.abort(key)
                    out.append(RetryLater(f"block {key!r}: the node is registering with a master"))
                    continue
                if accept is not None and not accept[i]:
                    self.engine.abort(key)
                    out.append(None)
                    continue
                if not self.arena.is_pending(key):
                    # Committed or dropped meanwhile (the slices of one block commit once).
                    stored = key in self.arena and self.arena.entry(key).checksum == expected
                    out.append(None if stored else InvalidArgument(f"block {key!r} is no longer being written"))
                elif actual != expected:
                    self.engine.abort(key)
                    out.append(
                        CorruptBlock(f"block {key!r} does not match the checksum its writer sent ({expected:#x})")
                    )
                else:
                    self.engine.commit(key, expected, pinned=pins[i], write_id=ids[i])
                    self._unconfirmed.pop(key, None)
                    if not confirmed:
                        self._unconfirmed[key] = (self.arena.extent(key).offset, expected)
                        if len(self._unconfirmed) > MAX_UNCONFIRMED:
                            self._unconfirmed.popitem(last=False)
                    out.append(None)
        return out

    def abort_writes(self, blocks: Sequence[tuple[BlockKey, memoryview]]) -> None:
        with self.lock.exclusive():
            for key, view in blocks:
                view.release()
                self.engine.abort(key)

    # -- orphans (see server.daemon.orphans) ------------------------------------------------
    def held_keys(self) -> list[BlockKey]:
        """Every block committed here, both tiers."""
        with self.lock.shared():
            return [e.key for e in self.arena.entries()] + [e.key for e in (self.ssd.entries() if self.ssd else [])]

    def describe(self, keys: Sequence[BlockKey]) -> list[BlockState | None]:
        """Each block as held now: (DRAM offset or -1 on SSD, size, checksum or -1 while it is being
        written); None for a key not held."""
        out: list[BlockState | None] = []
        with self.lock.shared():
            for key in keys:
                out.append(self._state(key))
        return out

    def occupants(self, refused: Sequence[tuple[BlockKey, int, int]]) -> list[BlockKey]:
        """The blocks in the way of writes refused for (key, offset, size): holding the key, or in DRAM
        over the extent."""
        found: set[BlockKey] = set()
        wanted: list[tuple[int, int]] = []
        with self.lock.shared():
            for key, offset, size in refused:
                if key in self.arena or self.arena.is_pending(key):
                    found.add(key)
                else:
                    wanted.append((offset, offset + align_up(size, self.arena.alignment)))
            if wanted:
                for key, extent in self.arena.extents():
                    if any(extent.offset < end and start < extent.offset + extent.length for start, end in wanted):
                        found.add(key)
        return sorted(found)

    def _state(self, key: BlockKey) -> BlockState | None:
        arena = self.arena
        if key in arena:
            entry = arena.entry(key)
            return BlockState(arena.extent(key).offset, entry.size, entry.checksum)
        pending = arena.pending(key)
        if pending is not None:
            return BlockState(pending[0], pending[1], -1)
        if self.ssd is not None and key in self.ssd:
            entry = self.ssd.entry(key)
            return BlockState(-1, entry.size, entry.checksum)
        return None

    @contextmanager
    def watching(self) -> Iterator[None]:
        """While an orphan check is in flight: note the keys whose writes begin (see :meth:`unchanged`)."""
        with self.lock.exclusive():
            self._watch = set()
        try:
            yield
        finally:
            with self.lock.exclusive():
                self._watch = None

    def unchanged(self, blocks: Sequence[tuple[BlockKey, BlockState]]) -> list[tuple[BlockKey, BlockState]]:
        """Those of ``blocks`` still held exactly as described and not written anew since the check
        began (call inside :meth:`watching`)."""
        with self.lock.exclusive():
            return self._unchanged(blocks)

    def _unchanged(self, blocks: Sequence[tuple[BlockKey, BlockState]]) -> list[tuple[BlockKey, BlockState]]:
        watch = self._watch or set()
        return [(k, state) for k, state in blocks if k not in watch and self._state(k) == state]

    def drop_orphans(self, blocks: Sequence[tuple[BlockKey, BlockState]]) -> list[BlockKey]:
        """Drop each of ``blocks`` that is :meth:`unchanged` (checked again under the same lock as the
        drop); returns those dropped. The caller first stops any receive into them."""
        with self.lock.exclusive():
            if self._registering:  # the inventory on its way names them: the next check drops them
                return []
            gone = [k for k, _ in self._unchanged(blocks)]
            self.engine.drop(gone)
            self._left_dram(gone)
        return gone

    def holds(self, key: BlockKey) -> bool:
        """Whether a committed block ``key`` is here, in either tier."""
        return key in self.arena or (self.ssd is not None and key in self.ssd)

    def vouched(self, key: BlockKey) -> bool:
        """Whether the block ``key`` held here (if any) is one the master knows of: not a two-trip
        put's block it has not vouched for (``_unconfirmed``), which may be an orphan."""
        with self.lock.shared():
            return key not in self._unconfirmed or self._vouched(key, 0, 0)  # as a reader by key alone

    # -- reads ---------------------------------------------------------------------
    @contextmanager
    def read_views(
        self,
        keys: Sequence[BlockKey],
        checksums: list[int] | None = None,
        tiers: list[str] | None = None,
        wait_s: float = 0.0,
        asked: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> Iterator[list[memoryview | None]]:
        """Zero-copy views of the blocks held (None for the others), valid inside the ``with``.
        ``checksums``, when given, is filled with each block's checksum (0 for those not held);
        ``tiers`` with the tier each was read from ("dram", "ssd", or "" for those not held).

        ``asked``: the (offsets, sizes) a ReadBlocks named; a block asked with size 0 came by key
        alone, and one the master has not vouched for is not held for it (``_unconfirmed``); one
        asked at its very extent by a reader the master sent is vouched for from then on. Without
        ``asked`` every block held is served (a range read, located first).

        Raises NotReady when this node may not serve by key (:attr:`serving`, waited for up to
        ``wait_s``): the master may have counted a drop here as done, and a miss would be a lie
        about the blocks it holds for the others."""
        arena = self.arena
        if asked is not None and not len(asked[0]) == len(asked[1]) == len(keys):
            raise InvalidArgument(f"a read of {len(keys)} blocks with {len(asked[0])} offsets, {len(asked[1])} sizes")
        if not self.serving(wait_s):
            raise NotReady("this node's lease with the master lapsed (cut off, or the master stalled): "
                           "it serves no block until the master answers it")  # fmt: skip
        if asked is not None and not all(asked[1]) and not self.serving_by_key():
            raise NotReady("this node's lease to serve by key lapsed (it may owe the master drops): "
                           "ask the master where the blocks are")  # fmt: skip
        with self.lock.shared():
            views: list[memoryview | None] = [None] * len(keys)
            on_ssd: list[int] = []
            taken: list[memoryview] = []
            try:
                for i, key in enumerate(keys):
                    if (
                        asked is not None
                        and key in self._unconfirmed
                        and not self._vouched(key, asked[0][i], asked[1][i])
                    ):
                        continue
                    if key in arena:
                        view = views[i] = arena.view(key)
                        taken.append(view)
                    elif self.ssd is not None and key in self.ssd:
                        on_ssd.append(i)
                if checksums is not None:
                    checksums[:] = [
                        arena.entry(k).checksum if v is not None else 0 for k, v in zip(keys, views, strict=True)
                    ]
                    for i in on_ssd:
                        assert self.ssd is not None
                        checksums[i] = self.ssd.entry(keys[i]).checksum
                if tiers is not None:
                    tiers[:] = ["" if v is None else "dram" for v in views]
                if not on_ssd or self.ssd is None:
                    yield views
                    return
                with self.ssd.views([keys[i] for i in on_ssd]) as ssd_views:
                    for i, view in zip(on_ssd, ssd_views, strict=True):
                        views[i] = view
                        if tiers is not None and view is not None:
                            tiers[i] = "ssd"
                    yield views
            finally:
                failure: BufferError | None = None
                for view in taken:  # every one, even after one that is still exported (as ExitStack did)
                    try:
                        view.release()
                    except BufferError as exc:
                        failure = failure or exc
                if failure is not None:
                    raise failure

    def _vouched(self, key: BlockKey, offset: int, size: int) -> bool:
        """(Under the lock, ``key`` in ``_unconfirmed``.) Whether ``key`` may be served to a reader who
        asked for it at (``offset``, ``size``): size 0 is a reader by key alone."""
        noted = self._unconfirmed.get(key)  # another reader may have taken it meanwhile
        if noted is None:
            return True
        at, check = noted
        if key not in self.arena or self.arena.extent(key).offset != at or self.arena.entry(key).checksum != check:
            self._unconfirmed.pop(key, None)  # dropped, moved or rewritten since: not that block
            return True
        if not size:
            return False
        if offset == at:
            self._unconfirmed.pop(key, None)  # the master sent this reader to this very block
        return True

    def confirm(self, blocks: Sequence[tuple[BlockKey, BlockState]]) -> None:
        """Blocks the master said it knows as described (an orphan check): served by key from now on."""
        with self.lock.exclusive():
            for key, state in blocks:
                if self._unconfirmed.get(key) == (state.offset, state.checksum):
                    del self._unconfirmed[key]

    def unconfirmed(self) -> int:
        """How many blocks wait for the master's word (see ``_unconfirmed``)."""
        return len(self._unconfirmed)

    # -- the master's commands -------------------------------------------------------------
    def demote(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Move DRAM blocks to SSD; False for a block that SSD could not take (dropped instead) or that is absent.

        A block being written is given up: committed at the master (a one-trip put) and not yet
        here, it is evicted before it lands, so it must not land in the extent the master frees now."""
        with self.lock.exclusive():
            self._refuse_while_registering()
            moved = self.engine.demote(keys)
            self._left_dram(keys)  # the master's command: it knows them (and dropped ones are gone)
            return moved

    def drop(
        self, keys: Sequence[BlockKey], tier: str = "", fences: Sequence[int] = (), at: Sequence[int] = (),
        keep: Callable[[BlockKey, BlockState | None], bool] | None = None,
    ) -> list[bool]:  # fmt: skip
        """Delete blocks from whichever tier holds them (and reservations given up, revoked or
        expired, with slices written), or from ``tier`` only ("dram" or "ssd"); False for a block
        that was not held there, or kept.

        ``at`` (per key, a DRAM offset; negative: any): reservations given up, each dropped only
        where it was reserved; a block of the key elsewhere is another put's and stays. ``keep``:
        asked, under the same lock as the drop, about each block held (with its state): True keeps it.

        ``fences`` (per key, a DRAM offset): these are copies from other daemons that the master
        gave up on. One that has not arrived (neither stored nor being written in DRAM) is fenced
        off: a fetch of that key into that offset that comes later is refused, so a copy whose drop
        was answered never becomes a stored block in an extent the master reuses."""
        if fences and len(fences) != len(keys):
            raise InvalidArgument(f"a drop of {len(keys)} blocks with {len(fences)} fences")
        if at and len(at) != len(keys):
            raise InvalidArgument(f"a drop of {len(keys)} blocks with {len(at)} reserved offsets")
        with self.lock.exclusive():
            self._refuse_while_registering()
            if fences:
                for key, offset in zip(keys, fences, strict=True):
                    if key not in self.arena and not self.arena.is_pending(key):
                        self._fence(key, offset)
            if not at and keep is None:
                dropped = self.engine.drop(keys, tier)
            else:
                kept = [
                    (bool(at) and at[i] >= 0 and self.arena.offset_of(k) not in (None, at[i]))
                    or (keep is not None and keep(k, self._state(k)))
                    for i, k in enumerate(keys)
                ]
                done = iter(self.engine.drop([k for k, no in zip(keys, kept, strict=True) if not no], tier))
                dropped = [False if no else next(done) for no in kept]
            self._left_dram(keys)
            return dropped

    def _left_dram(self, keys: Sequence[BlockKey]) -> None:
        """(Under the exclusive lock.) Forget the unconfirmed notes of ``keys`` no longer in DRAM, so
        that notes of dropped blocks do not pile up (``_unconfirmed``)."""
        if self._unconfirmed:
            for key in keys:
                if key in self._unconfirmed and key not in self.arena:
                    del self._unconfirmed[key]

    def _fence(self, key: BlockKey, offset: int) -> None:
        self._fences[(key, offset)] = None
        self._fences.move_to_end((key, offset))
        while len(self._fences) > MAX_FENCES:
            self._fences.popitem(last=False)

    def promote(self, keys: Sequence[BlockKey], offsets: Sequence[int]) -> list[bool]:
        """Move SSD blocks into the arena at the master's offsets; False where that failed (block stays on SSD)."""
        if len(keys) != len(offsets):
            raise InvalidArgument(f"promote got {len(keys)} keys but {len(offsets)} offsets")
        with self.lock.exclusive():
            self._refuse_while_registering()
            out = []
            for key, offset in zip(keys, offsets, strict=True):
                if key in self.arena and (self.ssd is None or key not in self.ssd):
                    out.append(self.arena.extent(key).offset == offset)  # a retried command, already done
                    continue
                # An extent the master chose that cannot be taken reports False; the master reuses it.
                out.append(self.engine.promote(key, partial(self._begin_at, key, offset)))
            return out

    def _begin_at(self, key: BlockKey, offset: int, size: int) -> memoryview:
        return self.arena.begin_at(key, offset, size)

    def close(self) -> None:
        with self.lock.exclusive():
            self.engine.close()

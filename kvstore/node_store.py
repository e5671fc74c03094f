"""One node's tiered block store: a DRAM arena in front of an LMDB SSD tier.

Rules (the policy in :mod:`kvstore.policy` decides, this class carries out):

- New blocks go to DRAM. A put that would fill DRAM past the high watermark
  first demotes DRAM's least recently used blocks to SSD (or drops them when
  SSD has no room), and SSD drops its own LRU blocks to take them.
- A get touches the block in its tier's LRU. A batch get leases its blocks
  while it runs, so that promoting one of them never evicts another. An SSD block read
  ``promote_after_hits`` times moves back to DRAM as its most recent block.
- A demoted block becomes SSD's most recent block; relative order among
  demoted blocks is kept.
- Putting an existing key keeps the stored bytes, touches it like a read
  (without counting a hit or promoting it) and returns :attr:`PutStatus.EXISTS`.
- Every block has an xxh3-64 checksum; reads verify it on request.
- Re-opening with the same config recovers both tiers, with DRAM's LRU order
  (DRAM persists each access) and SSD's write order.
- Commits, moves between tiers, drops and crash recovery (a crash mid-move
  leaves two copies: the DRAM one is the block) are the
  :class:`kvstore.tiers.engine.TierEngine`'s, the same code as the storage
  daemon's; this class adds the policy, the LRUs and the counters.

Thread-safe: public methods hold one lock. Invariants: a key is in exactly one
tier; each tier's LRU holds exactly that tier's keys with their sizes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Self

from kvstore.buffers import as_view
from kvstore.config import NodeConfig
from kvstore.errors import CapacityError, CorruptBlock, InvalidArgument, NotFound, StoreClosed
from kvstore.keys import BlockKey, checksum, validate_key
from kvstore.lru import LRU
from kvstore.policy import Action, ActionKind, EvictionPolicy, TierName, TierView
from kvstore.results import PutStatus
from kvstore.tiers.base import Tier
from kvstore.tiers.dram import DramArena
from kvstore.tiers.engine import TierEngine
from kvstore.tiers.ssd import SsdTier


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: str
    capacity: int
    used: int
    blocks: int

    @property
    def utilization(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


@dataclass(frozen=True, slots=True)
class NodeStats:
    dram: TierStats
    ssd: TierStats | None
    hits: int
    misses: int
    dram_hits: int
    ssd_hits: int
    puts: int
    put_exists: int
    demotions: int
    promotions: int
    dram_drops: int
    ssd_drops: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    dram_hits: int = 0
    ssd_hits: int = 0
    puts: int = 0
    put_exists: int = 0
    demotions: int = 0
    promotions: int = 0
    dram_drops: int = 0
    ssd_drops: int = 0


class NodeStore:
    def __init__(self, config: NodeConfig | None = None) -> None:
        self.config = config or NodeConfig()
        ev = self.config.eviction
        self.policy = EvictionPolicy(ev.high_watermark, ev.low_watermark, ev.promote_after_hits)
        self._lock = threading.RLock()
        self._counters = _Counters()
        self._ssd_hits: dict[str, int] = {}
        self._closed = False
        self.engine = TierEngine(self.config.dram, self.config.ssd, managed=True)
        self.dram: DramArena = self.engine.arena
        self.ssd: SsdTier | None = self.engine.ssd
        self._dram_lru: LRU[str] = LRU()
        self._ssd_lru: LRU[str] = LRU()
        self._recover()

    # -- recovery ------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuild both LRUs from what the tiers hold (the engine has resolved twins), oldest use first."""
        for lru, tier in ((self._dram_lru, self.dram), (self._ssd_lru, self.ssd)):
            for e in sorted(tier.entries(), key=lambda e: e.seq) if tier is not None else []:
                lru.insert(e.key, e.size)
                if e.pinned:
                    lru.pin(e.key)

    # -- writes ----------------------------------------------------------------
    def put(self, key: Any, data: Any, *, pin: bool = False) -> PutStatus:
        """Store ``data`` under ``key``; an existing key keeps its bytes and reports EXISTS.

        Raises :class:`CapacityError` when the block is larger than DRAM or
        DRAM cannot make room because the rest is pinned.
        """
        k = validate_key(key)
        view = as_view(data)
        with self._lock:
            self._check_open()
            return self._put(k, view, pin)

    def flush(self) -> None:
        """Nothing to wait for: a node store's put is visible when it returns."""

    def put_many(self, items: Iterable[tuple[Any, Any]], *, pin: bool = False) -> list[PutStatus]:
        """Store several blocks; every key and buffer is validated before anything is written."""
        checked = [(validate_key(k), as_view(d)) for k, d in items]
        with self._lock:
            self._check_open()
            return [self._put(k, v, pin) for k, v in checked]

    def _put(self, key: BlockKey, view: memoryview, pin: bool) -> PutStatus:
        if key in self._dram_lru or key in self._ssd_lru:
            # Someone just produced this block again: it is in use, so it counts as a touch.
            self._touch(key)
            self._counters.put_exists += 1
            return PutStatus.EXISTS
        size = view.nbytes
        if size <= 0:
            raise InvalidArgument(f"block {key!r} is empty; blocks must hold at least one byte")
        if size > self.dram.capacity:
            raise CapacityError(
                f"block {key!r} of {size} bytes is larger than the DRAM tier ({self.dram.capacity} bytes)"
            )

        def copy(dst: memoryview) -> None:
            dst[:] = view

        self._write_dram(key, size, checksum(view), pin, copy)
        self._counters.puts += 1
        return PutStatus.STORED

    def _write_dram(
        self, key: BlockKey, size: int, check: int, pinned: bool, fill: Callable[[memoryview], object]
    ) -> None:
        """Reserve DRAM for ``key``, let ``fill`` write its bytes, and commit it as DRAM's newest block."""
        dst = self._reserve_dram(key, size)
        try:
            fill(dst)
        except BaseException:
            dst.release()
            self.engine.abort(key)
            raise
        dst.release()
        self.engine.commit(key, check, pinned=pinned)
        self._dram_lru.insert(key, size)
        if pinned:
            self._dram_lru.pin(key)

    def _reserve_dram(self, key: BlockKey, size: int) -> memoryview:
        """Make room in DRAM (evicting by policy) and reserve ``size`` bytes for ``key``."""
        if self.policy.over_high_watermark(self.dram.used + size, self.dram.capacity):
            self._execute(self.policy.make_room(self._view(TierName.DRAM), self._ssd_view(), size))
        while True:
            dst = self.dram.begin(key, size)
            if dst is not None:
                return dst
            # Enough bytes but no contiguous extent (or no index slot): evict more, in LRU order.
            actions = self.policy.make_room(self._view(TierName.DRAM), self._ssd_view(), size, force_bytes=size)
            if not actions:
                raise CapacityError(
                    f"no room for block {key!r} of {size} bytes in DRAM: {self.dram.used} of "
                    f"{self.dram.capacity} bytes in use and nothing left to evict (pinned or leased)"
                )
            self._execute(actions)

    def _view(self, tier: TierName) -> TierView[str]:
        if tier is TierName.DRAM:
            return TierView(self.dram.capacity, self.dram.used, self._dram_lru)
        assert self.ssd is not None
        return TierView(self.ssd.capacity, self.ssd.used, self._ssd_lru)

    def _ssd_view(self) -> TierView[str] | None:
        return self._view(TierName.SSD) if self.ssd is not None else None

    def _execute(self, actions: Sequence[Action[str]]) -> None:
        ssd_drops = [BlockKey(a.key) for a in actions if a.kind is ActionKind.DROP and a.tier is TierName.SSD]
        demotes = [BlockKey(a.key) for a in actions if a.kind is ActionKind.DEMOTE]
        dram_drops = [BlockKey(a.key) for a in actions if a.kind is ActionKind.DROP and a.tier is TierName.DRAM]
        if ssd_drops:
            self.engine.drop(ssd_drops)
            for key in ssd_drops:
                self._ssd_lru.remove(key)
                self._ssd_hits.pop(key, None)
            self._counters.ssd_drops += len(ssd_drops)
        if demotes and self.ssd is not None:
            for key, moved in zip(demotes, self.engine.demote(demotes), strict=True):
                size = self._dram_lru.remove(key)
                if moved:
                    self._ssd_lru.insert(key, size)
                    self._counters.demotions += 1
                else:  # SSD could not take it: the engine dropped it
                    self._counters.dram_drops += 1
        else:
            dram_drops += demotes
        if dram_drops:
            self.engine.drop(dram_drops)
            for key in dram_drops:
                self._dram_lru.remove(key)
            self._counters.dram_drops += len(dram_drops)

    def _promote(self, key: BlockKey) -> bool:
        """Move an SSD block to DRAM; False (block stays on SSD) when DRAM cannot make room."""
        self._ssd_lru.lease(key)  # keep it out of SSD victims while DRAM makes room
        try:
            # _reserve_dram raises CapacityError when nothing is left to evict: the engine answers False.
            if not self.engine.promote(key, lambda size: self._reserve_dram(key, size)):
                return False
        finally:
            self._ssd_lru.release(key)
        entry = self.dram.entry(key)
        self._dram_lru.insert(key, entry.size)
        if entry.pinned:
            self._dram_lru.pin(key)
        self._ssd_lru.remove(key)
        self._ssd_hits.pop(key, None)
        self._counters.promotions += 1
        return True

    # -- reads -----------------------------------------------------------------
    def _touch(self, key: BlockKey) -> None:
        (self._dram_lru if key in self._dram_lru else self._ssd_lru).touch(key)
        self.engine.touch(key)

    def _locate(self, key: BlockKey) -> Tier | None:
        """The tier that serves ``key`` now (after touching and maybe promoting it), or None on a miss."""
        c = self._counters
        if key in self._dram_lru:
            self._touch(key)
            c.hits += 1
            c.dram_hits += 1
            return self.dram
        if key in self._ssd_lru:
            assert self.ssd is not None
            c.hits += 1
            c.ssd_hits += 1
            hits = self._ssd_hits.get(key, 0) + 1
            self._ssd_hits[key] = hits
            if self.policy.should_promote(hits) and self._promote(key):
                return self.dram
            self._touch(key)
            return self.ssd
        c.misses += 1
        return None

    def _verify(self, tier: Tier, key: BlockKey, data: memoryview | bytes, verify: bool | None) -> None:
        if verify or (verify is None and self.config.verify_reads):
            expected = tier.entry(key).checksum
            actual = checksum(data)
            if actual != expected:
                raise CorruptBlock(f"block {key!r} fails its checksum: stored {expected:#x}, read {actual:#x}")

    def get(self, key: Any, *, verify: bool | None = None) -> bytes | None:
        """The block's bytes, or None when the key is not stored."""
        k = validate_key(key)
        with self._lock:
            self._check_open()
            return self._get(k, verify)

    def _get(self, key: BlockKey, verify: bool | None) -> bytes | None:
        tier = self._locate(key)
        if tier is None:
            return None
        data = tier.read(key)
        self._verify(tier, key, data, verify)
        return data

    def get_into(self, key: Any, buffer: Any, *, verify: bool | None = None) -> int | None:
        """Copy the block into ``buffer`` (no intermediate copy); its size, or None when not stored.

        Raises :class:`kvstore.errors.BufferTooSmall` when ``buffer`` is smaller than the block.
        """
        k = validate_key(key)
        dst = as_view(buffer, writable=True, what="buffer")
        with self._lock:
            self._check_open()
            return self._get_into(k, dst, verify)

    def _get_into(self, key: BlockKey, dst: memoryview, verify: bool | None) -> int | None:
        tier = self._locate(key)
        if tier is None:
            return None
        n = tier.read_into(key, dst)
        self._verify(tier, key, dst[:n], verify)
        return n

    def get_many(self, keys: Iterable[Any], *, verify: bool | None = None) -> list[bytes | None]:
        checked = [validate_key(k) for k in keys]
        with self._lock:
            self._check_open()
            with self._leased(checked):
                return [self._get(k, verify) for k in checked]

    def get_many_into(
        self, keys: Sequence[Any], buffers: Sequence[Any], *, verify: bool | None = None
    ) -> list[int | None]:
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get_many_into got {len(keys)} keys but {len(buffers)} buffers")
        checked = [validate_key(k) for k in keys]
        views = [as_view(b, writable=True, what="buffer") for b in buffers]
        with self._lock:
            self._check_open()
            with self._leased(checked):
                return [self._get_into(k, v, verify) for k, v in zip(checked, views, strict=True)]

    @contextmanager
    def _leased(self, keys: Sequence[BlockKey]) -> Iterator[None]:
        """Lease a batch's blocks while it is read, so that promoting one never evicts another."""
        for k in keys:
            if k in self._dram_lru:
                self._dram_lru.lease(k)
            elif k in self._ssd_lru:
                self._ssd_lru.lease(k)
        try:
            yield
        finally:
            for k in keys:  # a promoted block lost its SSD lease with its SSD entry; release is idempotent
                self._dram_lru.release(k)
                self._ssd_lru.release(k)

    # -- queries and removal -----------------------------------------------------
    def exists(self, key: Any) -> bool:
        k = validate_key(key)
        with self._lock:
            return k in self._dram_lru or k in self._ssd_lru

    def exists_many(self, keys: Iterable[Any]) -> list[bool]:
        checked = [validate_key(k) for k in keys]
        with self._lock:
            return [k in self._dram_lru or k in self._ssd_lru for k in checked]

    def match_prefix(self, keys: Iterable[Any]) -> int:
        """How many leading ``keys`` are stored: the longest stored prefix. Does not touch the LRU."""
        checked = [validate_key(k) for k in keys]
        with self._lock:
            for i, k in enumerate(checked):
                if k not in self._dram_lru and k not in self._ssd_lru:
                    return i
            return len(checked)

    def tier_of(self, key: Any) -> TierName | None:
        k = validate_key(key)
        with self._lock:
            if k in self._dram_lru:
                return TierName.DRAM
            return TierName.SSD if k in self._ssd_lru else None

    def lru_keys(self, tier: TierName) -> list[str]:
        """The keys of ``tier``, least recently used first."""
        with self._lock:
            return list(self._dram_lru if tier is TierName.DRAM else self._ssd_lru)

    def delete(self, key: Any) -> bool:
        """Remove a block; False when it was not stored."""
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Iterable[Any]) -> int:
        """Remove blocks; returns how many were stored."""
        checked = [validate_key(k) for k in keys]
        with self._lock:
            self._check_open()
            held = [k for k in dict.fromkeys(checked) if k in self._dram_lru or k in self._ssd_lru]
            self.engine.drop(held)
            for k in held:
                if k in self._dram_lru:
                    self._dram_lru.remove(k)
                else:
                    self._ssd_lru.remove(k)
                    self._ssd_hits.pop(k, None)
            return len(held)

    def pin(self, key: Any) -> None:
        """Exempt a block from eviction until :meth:`unpin`; raises :class:`NotFound` if absent."""
        self._set_pinned(validate_key(key), True)

    def unpin(self, key: Any) -> None:
        self._set_pinned(validate_key(key), False)

    def _set_pinned(self, key: BlockKey, pinned: bool) -> None:
        with self._lock:
            self._check_open()
            tier: Tier
            if key in self._dram_lru:
                lru, tier = self._dram_lru, self.dram
            elif key in self._ssd_lru and self.ssd is not None:
                lru, tier = self._ssd_lru, self.ssd
            else:
                raise NotFound(f"cannot {'pin' if pinned else 'unpin'} {key!r}: not stored")
            tier.set_pinned(key, pinned)
            if pinned:
                lru.pin(key)
            else:
                lru.unpin(key)

    def stats(self) -> NodeStats:
        with self._lock:
            return NodeStats(
                dram=TierStats("dram", self.dram.capacity, self.dram.used, len(self._dram_lru)),
                ssd=TierStats("ssd", self.ssd.capacity, self.ssd.used, len(self._ssd_lru)) if self.ssd else None,
                **asdict(self._counters),
            )

    # -- lifecycle -------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this NodeStore is closed")

    def close(self) -> None:
        """Close both tiers, keeping their contents for the next open; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.engine.close()

    def destroy(self) -> None:
        """Close and delete both tiers' files and every block in them."""
        self.close()
        DramArena.remove(self.config.dram)
        if self.ssd is not None:
            for name in ("data.mdb", "lock.mdb", "kvstore.lock"):
                (self.ssd.path / name).unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

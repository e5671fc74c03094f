"""NodeStore against a simple model: a dict of bytes and one ordered list per tier.

Blocks all have one size and watermarks are 1.0, so the model can state the
exact outcome of every step: which tier holds each key, the exact LRU order of
each tier, capacity never exceeded, and bytes always equal. Re-opening the
store is a step too: DRAM keeps its order, SSD comes back in write order.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import CapacityError
from kvstore.node_store import NodeStore
from kvstore.policy import TierName
from kvstore.results import PutStatus
from kvstore.tiers.dram import DramArena
from tests.conftest import node_config

SIZE = 512
DRAM_BLOCKS, SSD_BLOCKS, PROMOTE_AFTER = 4, 5, 2
KEYS = st.sampled_from([f"key-{i}" for i in range(14)])


class Model:
    """What the store must hold: per tier an ordered list, oldest first."""

    def __init__(self, ssd_blocks: int) -> None:
        self.data: dict[str, bytes] = {}
        self.dram: list[str] = []
        self.ssd: list[str] = []
        self.ssd_blocks = ssd_blocks
        self.pinned: set[str] = set()
        self.hits: dict[str, int] = {}
        self.written: dict[str, int] = {}  # SSD write order, which survives a reopen
        self.clock = 0

    def _victim(self, tier: list[str], exclude: str | None = None) -> str | None:
        return next((k for k in tier if k not in self.pinned and k != exclude), None)

    def _make_dram_room(self, exclude_ssd: str | None = None) -> bool:
        """Free one DRAM block if DRAM is full: demote it, dropping SSD's LRU block if needed."""
        if len(self.dram) < DRAM_BLOCKS:
            return True
        victim = self._victim(self.dram)
        if victim is None:
            return False
        self.dram.remove(victim)
        if self.ssd_blocks:
            if len(self.ssd) >= self.ssd_blocks:
                drop = self._victim(self.ssd, exclude=exclude_ssd)
                if drop is None:
                    self._forget(victim)
                    return True
                self.ssd.remove(drop)
                self._forget(drop)
            self.ssd.append(victim)
            self.clock += 1
            self.written[victim] = self.clock
        else:
            self._forget(victim)
        return True

    def _forget(self, key: str) -> None:
        del self.data[key]
        self.pinned.discard(key)
        self.hits.pop(key, None)

    def _touch(self, key: str) -> None:
        tier = self.dram if key in self.dram else self.ssd
        tier.remove(key)
        tier.append(key)

    def put(self, key: str, value: bytes, pin: bool) -> PutStatus | type[CapacityError]:
        if key in self.data:
            self._touch(key)
            return PutStatus.EXISTS
        if not self._make_dram_room():
            return CapacityError
        self.data[key] = value
        self.dram.append(key)
        if pin:
            self.pinned.add(key)
        return PutStatus.STORED

    def get(self, key: str) -> bytes | None:
        if key not in self.data:
            return None
        if key in self.ssd:
            self.hits[key] = self.hits.get(key, 0) + 1
            if self.hits[key] >= PROMOTE_AFTER and self._make_dram_room(exclude_ssd=key):
                self.ssd.remove(key)
                self.hits.pop(key)
                self.dram.append(key)
                return self.data[key]
        self._touch(key)
        return self.data[key]

    def delete(self, key: str) -> bool:
        if key not in self.data:
            return False
        (self.dram if key in self.dram else self.ssd).remove(key)
        self._forget(key)
        return True

    def reopen(self) -> None:
        self.ssd.sort(key=lambda k: self.written[k])
        self.hits.clear()


class NodeStoreMachine(RuleBasedStateMachine):
    ssd_blocks = SSD_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvstore-prop-"))
        self.config = node_config(
            self.tmp,
            dram=DRAM_BLOCKS * SIZE,
            ssd=self.ssd_blocks * SIZE,
            eviction={"high_watermark": 1.0, "low_watermark": 1.0, "promote_after_hits": PROMOTE_AFTER},
        )
        self.store = NodeStore(self.config)
        self.model = Model(self.ssd_blocks)
        self.version = 0

    def teardown(self) -> None:
        self.store.destroy()
        DramArena.remove(self.config.dram)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _value(self, key: str) -> bytes:
        self.version += 1
        return (f"{key}:{self.version}:".encode() * SIZE)[:SIZE]

    @rule(key=KEYS, pin=st.sampled_from([False, False, False, True]))
    def put(self, key: str, pin: bool) -> None:
        value = self._value(key)
        expected = self.model.put(key, value, pin)
        if expected is CapacityError:
            with pytest.raises(CapacityError):
                self.store.put(key, value, pin=pin)
        else:
            assert self.store.put(key, value, pin=pin) is expected

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def put_many(self, keys: list[str]) -> None:
        items = [(k, self._value(k)) for k in keys]
        expected = []
        for k, v in items:  # the store stops at the first failure; so does the model
            expected.append(self.model.put(k, v, False))
            if expected[-1] is CapacityError:
                with pytest.raises(CapacityError):
                    self.store.put_many(items)
                return
        assert self.store.put_many(items) == expected

    @rule(key=KEYS, verify=st.booleans())
    def get(self, key: str, verify: bool) -> None:
        assert self.store.get(key, verify=verify) == self.model.get(key)

    @rule(key=KEYS)
    def get_into(self, key: str) -> None:
        buf = bytearray(SIZE + 7)
        expected = self.model.get(key)
        n = self.store.get_into(key, buf)
        assert (None if n is None else bytes(buf[:n])) == expected

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        assert self.store.delete(key) == self.model.delete(key)

    @precondition(lambda self: bool(self.model.data))
    @rule(data=st.data(), pin=st.booleans())
    def pin_or_unpin(self, data: st.DataObject, pin: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.model.data)))
        if pin:
            self.store.pin(key)
            self.model.pinned.add(key)
        else:
            self.store.unpin(key)
            self.model.pinned.discard(key)

    @rule(keys=st.lists(KEYS, max_size=5))
    def match_prefix(self, keys: list[str]) -> None:
        expected = next((i for i, k in enumerate(keys) if k not in self.model.data), len(keys))
        assert self.store.match_prefix(keys) == expected

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = NodeStore(self.config)
        self.model.reopen()

    @invariant()
    def tiers_match_the_model_exactly(self) -> None:
        assert self.store.lru_keys(TierName.DRAM) == self.model.dram
        assert self.store.lru_keys(TierName.SSD) == self.model.ssd
        assert self.store.dram.used <= self.store.dram.capacity
        if self.store.ssd is not None:
            assert self.store.ssd.used <= self.store.ssd.capacity
            assert not set(self.model.dram) & set(self.model.ssd)


class DramOnlyMachine(NodeStoreMachine):
    ssd_blocks = 0


TestNodeStore = NodeStoreMachine.TestCase
TestNodeStore.settings = settings(stateful_step_count=40)
TestDramOnlyNodeStore = DramOnlyMachine.TestCase
TestDramOnlyNodeStore.settings = settings(stateful_step_count=30, max_examples=25)

"""The tier engine both NodeStore and the daemon use: pending writes, twins, retried moves."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config import DramConfig, SsdConfig
from kvstore.keys import BlockKey, checksum
from kvstore.tiers.engine import TierEngine

K = BlockKey
KB = 1024


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[TierEngine]:
    e = TierEngine(
        DramConfig(capacity=16 * KB, name="eng", shm_dir=tmp_path, prefault=False),
        SsdConfig(capacity=64 * KB, path=tmp_path / "ssd"),
        managed=True,
    )
    yield e
    e.close()


def put(e: TierEngine, key: str, data: bytes) -> None:
    view = e.arena.begin(K(key), len(data))
    assert view is not None
    view[:] = data
    view.release()
    e.commit(K(key), checksum(data))


def test_a_pending_write_is_given_up_by_a_demotion_or_a_drop(engine: TierEngine) -> None:
    for key in ("p", "q"):
        assert engine.arena.begin(K(key), KB) is not None
    assert engine.arena.used == 2 * KB
    assert engine.demote([K("p")]) == [False]  # evicted before it landed: nothing to move
    assert engine.drop([K("q"), K("absent")]) == [True, False]
    assert not engine.arena.is_pending(K("p")) and not engine.arena.is_pending(K("q"))
    assert engine.arena.used == 0 and engine.ssd is not None and len(engine.ssd) == 0


def test_moves_are_idempotent_and_keep_sequence_order(engine: TierEngine) -> None:
    put(engine, "a", b"a" * KB)
    put(engine, "b", b"b" * KB)
    assert engine.demote([K("a")]) == [True]
    assert engine.demote([K("a")]) == [True]  # retried: already on SSD
    assert engine.promote(K("b"), lambda size: None) is False  # not on SSD
    assert engine.promote(K("a"), lambda size: None) is False  # no room: stays on SSD
    assert engine.ssd is not None and K("a") in engine.ssd
    assert engine.promote(K("a"), lambda size: engine.arena.begin(K("a"), size)) is True
    assert K("a") not in engine.ssd and engine.arena.read(K("a")) == b"a" * KB
    assert engine.arena.entry(K("a")).seq > engine.arena.entry(K("b")).seq  # promoted: the newest


def test_a_twin_is_reused_only_with_the_same_bytes(engine: TierEngine) -> None:
    assert engine.ssd is not None
    put(engine, "same", b"s" * KB)
    put(engine, "other", b"o" * KB)
    engine.ssd.store(K("same"), memoryview(b"s" * KB), checksum(b"s" * KB), 0)
    engine.ssd.store(K("other"), memoryview(b"x" * KB), checksum(b"x" * KB), 0)
    assert engine.demote([K("same"), K("other")]) == [True, True]
    assert engine.ssd.read(K("same")) == b"s" * KB and engine.ssd.read(K("other")) == b"o" * KB
    put(engine, "both", b"b" * KB)
    engine.ssd.store(K("both"), memoryview(b"b" * KB), checksum(b"b" * KB), 0)
    assert engine.drop([K("both")]) == [True]
    assert K("both") not in engine.arena and K("both") not in engine.ssd  # a drop deletes both copies

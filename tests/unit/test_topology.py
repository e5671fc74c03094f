"""Topology from the kernel, and mapping another process's arena."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.arena_format import ArenaMapping
from kvstore.config import DramConfig
from kvstore.errors import CorruptStore, InvalidArgument
from kvstore.keys import checksum
from kvstore.tiers.dram import DramArena
from transfer import topology


def test_local_nics_include_loopback_last_with_its_address() -> None:
    nics = topology.local_nics()
    assert nics and nics[-1].name == "lo" and nics[-1].address == "127.0.0.1"
    assert all(topology.nic_speed_mbps(n) > 0 for n in nics)
    assert all(n.name != "lo" for n in topology.local_nics(include_loopback=False))


def test_speed_and_numa_come_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "lo" / "device").mkdir(parents=True)
    (tmp_path / "lo" / "operstate").write_text("unknown\n")
    (tmp_path / "lo" / "speed").write_text("25000\n")
    (tmp_path / "lo" / "device" / "numa_node").write_text("1\n")
    (tmp_path / "gone0").mkdir()
    (tmp_path / "gone0" / "operstate").write_text("down\n")
    [nic] = topology.local_nics(tmp_path)
    assert (nic.name, nic.address, nic.speed_mbps, nic.numa_node) == ("lo", "127.0.0.1", 25000, 1)


def test_host_id_is_stable() -> None:
    assert topology.host_id() == topology.host_id() and "/" in topology.host_id()


def test_an_arena_mapped_by_another_reader_sees_committed_bytes(tmp_path: Path) -> None:
    arena = DramArena(DramConfig(capacity=1 << 20, name="mapped", shm_dir=tmp_path, prefault=False))
    try:
        view = arena.begin("k", 5)
        assert view is not None
        view[:] = b"hello"
        view.release()
        arena.commit("k", checksum(b"hello"), 1)
        mapping = ArenaMapping(arena.path)
        assert topology.same_file(str(arena.path), mapping.inode)
        src = mapping.extent(arena.extent("k").offset, 5)
        assert bytes(src) == b"hello"
        src.release()
        with pytest.raises(InvalidArgument, match="outside"):
            mapping.extent(1 << 20, 1)
        mapping.close()
    finally:
        arena.close()


def test_mapping_something_else_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "not-an-arena").write_bytes(b"x" * 8192)
    with pytest.raises(CorruptStore, match="not a kvstore DRAM arena"):
        ArenaMapping(tmp_path / "not-an-arena")
    with pytest.raises(CorruptStore, match="cannot open"):
        ArenaMapping(tmp_path / "absent")

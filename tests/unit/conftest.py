"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config import DramConfig, SsdConfig
from server.daemon.storage import DaemonStorage

KB = 1024


def storage_configs(tmp_path: Path) -> tuple[DramConfig, SsdConfig]:
    """The tiers of :func:`storage`'s daemon (opened again, they are its arena and SSD): 64 KiB of DRAM,
    256 KiB of SSD, under ``tmp_path``."""
    return (
        DramConfig(capacity=64 * KB, name="unit", shm_dir=tmp_path, prefault=False),
        SsdConfig(capacity=256 * KB, path=tmp_path / "ssd"),
    )


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[DaemonStorage]:
    """A daemon's storage with its tiers under ``tmp_path`` (:func:`storage_configs`)."""
    s = DaemonStorage(*storage_configs(tmp_path))
    yield s
    s.close()

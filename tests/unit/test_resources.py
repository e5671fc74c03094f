"""Start-up checks of tier sizes against the machine, reservation of an arena's pages, and the
rate-limited log of failures that repeat."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import ResourceShortage
from kvstore.ratelog import RateLimitedLog
from kvstore.resources import allocated, check_dram, check_ssd, fs_free, memory_available, reserve

MiB = 1024**2


def test_sizes_that_fit_pass_unchanged(tmp_path: Path) -> None:
    assert check_dram(tmp_path / "kvstore-a.arena", 4 * MiB).size == 4 * MiB
    fit = check_ssd(tmp_path / "ssd", 4 * MiB)
    assert fit.size == 4 * MiB and fit.warning is None


def test_more_than_the_filesystem_has_is_refused_with_the_sizes(small_fs: Any) -> None:
    fs = small_fs("16m")
    with pytest.raises(ResourceShortage) as exc:
        check_dram(fs / "kvstore-a.arena", 64 * MiB)
    message = str(exc.value)
    assert "64.0 MiB" in message and "16.0 MiB" in message and str(fs) in message and "--dram" in message
    with pytest.raises(ResourceShortage, match=r"SSD tier .* 64\.0 MiB .*--ssd"):
        check_ssd(fs / "ssd", 64 * MiB)
    assert list(fs.iterdir()) == []  # a check creates nothing


def test_clamping_leaves_a_share_of_what_is_free_and_says_so(small_fs: Any) -> None:
    fs = small_fs("16m")
    fit = check_ssd(fs / "ssd", 64 * MiB, clamp=True)
    assert 0 < fit.size <= 16 * MiB and fit.warning is not None and "clamped --ssd" in fit.warning
    # What the tier holds already counts as had: only the rest must be free.
    assert check_ssd(fs / "ssd", 64 * MiB, used=60 * MiB).size == 64 * MiB


def test_memory_bounds_the_dram_tier(tmp_path: Path) -> None:
    mem = memory_available()
    assert mem is not None and mem > 0
    if fs_free(tmp_path) <= 2 * mem:
        pytest.skip("the test directory's filesystem is not larger than memory")
    with pytest.raises(ResourceShortage, match="memory"):
        check_dram(tmp_path / "kvstore-a.arena", 2 * mem)


def test_reserve_allocates_every_page_or_fails_typed(small_fs: Any) -> None:
    fs = small_fs("8m")
    path = fs / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve(fd, 4 * MiB, "test file", chunk=MiB)
        assert allocated(path) >= 4 * MiB
        with pytest.raises(ResourceShortage, match=r"test file: only .* of 16\.0 MiB could be reserved"):
            reserve(fd, 16 * MiB, "test file", chunk=MiB)
    finally:
        os.close(fd)


def test_repeated_failures_are_one_line_a_minute_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.ratelog"), interval_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        assert limited.warning("ssd", "write failed: %s", "ENOSPC")
        for _ in range(500):
            now[0] += 0.1
            assert not limited.warning("ssd", "write failed: %s", "ENOSPC")
        assert limited.warning("other", "another kind")  # kinds are counted apart
        now[0] += 11
        assert limited.warning("ssd", "write failed: %s", "ENOSPC")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "write failed: ENOSPC",
        "another kind",
        "write failed: ENOSPC (and 500 more like it in the last 61 s)",
    ]


def test_failures_from_many_threads_are_counted_once_each(caplog: pytest.LogCaptureFixture) -> None:
    # A daemon's accept thread and its connection threads log refusals through one RateLimitedLog.
    limited = RateLimitedLog(logging.getLogger("test.ratelog.threads"), interval_s=3600)
    with caplog.at_level(logging.WARNING, "test.ratelog.threads"):
        threads = [
            threading.Thread(target=lambda: [limited.warning("refused", "refused") for _ in range(1000)])
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.getMessage() for r in caplog.records] == ["refused"]
    assert limited._kinds["refused"].suppressed == 8 * 1000 - 1

"""SIGKILL a process that is writing, re-open its store, and read every committed block back."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstore.node_store import NodeStore
from kvstore.policy import TierName
from tests.conftest import node_config
from tests.fault.writer import block_bytes

REPO = Path(__file__).resolve().parents[2]
BLOCK = 48 * 1024


def run_until_killed(config_json: str, first: int, count: int, kill_after: int, seed: int) -> int:
    """Start a writer, SIGKILL it once it has committed ``kill_after`` blocks; the last committed index."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fault.writer", config_json, str(first), str(count), str(seed)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    last = first - 1
    deadline = time.monotonic() + 60
    try:
        for line in proc.stdout:
            if line.startswith("committed "):
                last = int(line.split()[1])
                if last - first + 1 >= kill_after:
                    break
            elif line.startswith("done"):
                break
            assert time.monotonic() < deadline, "writer is too slow"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    return last


def test_committed_blocks_survive_repeated_sigkill(tmp_path: Path) -> None:
    # DRAM holds ~20 blocks, so most blocks are demoted to SSD; SSD holds them all, so none is dropped.
    config = node_config(
        tmp_path,
        dram=20 * BLOCK,
        ssd=400 * BLOCK,
        eviction={"promote_after_hits": 1},
    )
    config_json = config.model_dump_json()
    rng = random.Random(7)
    committed = -1
    for round_ in range(3):
        kill_after = rng.randint(40, 100)
        committed = run_until_killed(config_json, committed + 1, 150, kill_after, seed=round_)
    store = NodeStore(config)
    try:
        tiers = {TierName.DRAM: 0, TierName.SSD: 0}
        for i in range(committed + 1):
            tier = store.tier_of(f"k{i}")
            assert tier is not None, f"committed block k{i} lost"
            tiers[tier] += 1
            assert store.get(f"k{i}", verify=True) == block_bytes(i), f"committed block k{i} has wrong bytes"
        # The writer went on between its last line we read and the kill: whatever it completed is
        # there whole, and a put the kill cut short is not there at all.
        extra = [k for tier in TierName for k in store.lru_keys(tier) if int(k[1:]) > committed]
        for key in extra:
            assert store.get(key, verify=True) == block_bytes(int(key[1:])), f"{key} is visible but torn"
        assert tiers[TierName.SSD] > 0 and store.stats().dram.blocks > 0
        store.dram.allocator.check()
    finally:
        store.destroy()

"""bench.lmcache_connectors, small: LMCache's own connectors (kvstore://, and mooncakestore:// on the
Mooncake drop-in) move LMCache's chunks through real clusters and read back every byte; Mooncake
Store's row says why it is left out (no peers here). Runs where the LMCache environment is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.lmcache]
REPO = Path(__file__).resolve().parents[2]
LMCACHE = REPO / ".venv-lmcache" / "bin" / "python"


@pytest.mark.skipif(not LMCACHE.exists(), reason=f"no LMCache environment at {LMCACHE} (scripts/lmcache-env.sh)")
def test_lmcache_connectors_bench_moves_every_chunk_through_both_connectors(tmp_path: Path) -> None:
    env = {**os.environ, "PEERS_VENV": str(tmp_path / "no-peers")}
    args = ["--json", "--sizes", "64KiB", "--chunks", "6", "--batch", "4", "--rows", "kvstore,mooncake_dropin,mooncake"]
    out = subprocess.run([sys.executable, "-m", "bench.lmcache_connectors", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, out.stdout.splitlines())}
    for name in ("kvstore", "mooncake_dropin"):
        assert "failed" not in rows[name], rows[name]["failed"]
        assert rows[name]["bad"] == 0 and rows[name]["put_GBps"] > 0 and rows[name]["get_GBps"] > 0
    assert "not set up" in rows["mooncake"]["skipped"]
    assert rows["baseline"]["tcp_GBps"] > 0 and rows["baseline"]["memcpy_GBps"] > 0
    assert rows["ratios"]["kvstore_get_vs_tcp"] > 0 and "kvstore_get_vs_mooncake" not in rows["ratios"]

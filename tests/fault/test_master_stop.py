"""A master told to stop exits even when its stop hangs (one under an unreachable etcd outlived its
test by 100 minutes, idle in its event loop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, sys
from kvstore.config import MasterConfig
from server.master import main
from server.master.service import MasterService

async def hang(self):
    await asyncio.sleep(3600)  # a stop whose awaits never end

MasterService.stop = hang
main.STOP_DEADLINE_S = float(sys.argv[1])
sys.exit(main.run_master(MasterConfig(port=0)))
"""


def test_a_master_whose_stop_hangs_exits_after_the_deadline() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "1.0"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert time.monotonic() - began < 10
    assert "did not stop within 1 s of being told to" in err

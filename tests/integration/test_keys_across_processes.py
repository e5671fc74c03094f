"""Prefix keys are the same in every process, whatever its PYTHONHASHSEED."""

import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore.keys import block_keys

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (
    "import json; from kvstore.keys import block_keys; "
    "print(json.dumps(block_keys(list(range(1000, 1300)), 16, 'llama/fp16') + block_keys([7] * 64, 8)))"
)


def keys_in_subprocess(hash_seed: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return list(json.loads(out.stdout))


def test_keys_equal_across_processes_with_different_hash_seeds() -> None:
    a, b = keys_in_subprocess("1"), keys_in_subprocess("4242")
    assert a == b
    assert a == block_keys(list(range(1000, 1300)), 16, "llama/fp16") + block_keys([7] * 64, 8)
    assert len(set(a)) == len(a)

"""The peers' environment (``../shared/peers/setup.sh``): where Mooncake Store's wheel and
binaries are, and what its processes need to run here. Benches that measure against Mooncake
use these, and leave its rows out, saying why, where the peers are not set up."""

from __future__ import annotations

import os
from pathlib import Path

PEERS_VENV = Path(os.environ.get("PEERS_VENV", Path(os.environ.get("TMPDIR", "/tmp")) / "kvstore-peers"))


def mooncake_site() -> Path | None:
    """The peers' site-packages holding the ``mooncake`` package, or None."""
    return next((p for p in PEERS_VENV.glob("lib/python3*/site-packages") if (p / "mooncake").exists()), None)


def mooncake_env() -> dict[str, str]:
    """The environment Mooncake's binaries and Python module load in: its CUDA runtime (from the
    wheel's requirements) and the stub libcuda setup.sh builds (no GPU here)."""
    cuda = next(iter(PEERS_VENV.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib")), None)
    return {**os.environ, "LD_LIBRARY_PATH": f"{PEERS_VENV / 'stub'}:{cuda or ''}"}

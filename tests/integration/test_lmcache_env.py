"""LMCache's tests (``test_lmcache.py``) import LMCache, which pins numpy, transformers and
setuptools of its own: they run in ``.venv-lmcache`` (``scripts/lmcache-env.sh``, which the
README's test command runs; ``$KVSTORE_LMCACHE_PYTHON`` names another interpreter). This runs
them there from the main suite, and skips, saying why, where that environment was not built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_marked_tests_in

REPO = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("KVSTORE_LMCACHE_PYTHON") or str(REPO / ".venv-lmcache" / "bin" / "python")


@pytest.mark.lmcache
@pytest.mark.skipif(not Path(PYTHON).exists(), reason=f"no LMCache environment at {PYTHON} (scripts/lmcache-env.sh)")
def test_lmcache_against_its_own_classes_in_the_lmcache_environment() -> None:
    run_marked_tests_in(PYTHON, "lmcache", "tests/integration/test_lmcache.py", timeout=900)

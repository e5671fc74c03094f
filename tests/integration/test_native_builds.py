"""The data-plane tests again, under other builds of the native loops: the pure-Python fallback
(``KVSTORE_NO_NATIVE=1``) and the extension built with AddressSanitizer and UBSan, which also
runs the differential fuzz (bench.fuzz_native). Each run is a pytest of its own whose daemons,
started as processes, inherit the build: every byte the daemons and clients receive goes through it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DATA_PLANE_TESTS = [
    "tests/unit/test_wire.py",
    "tests/unit/test_native_wire.py",
    "tests/integration/test_cluster.py",
    "tests/integration/test_cached_puts.py",
    "tests/integration/test_daemon_defence.py",
]


def _pytest(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *DATA_PLANE_TESTS],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def _summary(out: subprocess.CompletedProcess[str]) -> str:
    return (out.stdout + out.stderr)[-3000:]


def test_the_data_plane_tests_pass_on_the_pure_python_fallback(tmp_path: Path) -> None:
    out = _pytest({"KVSTORE_NO_NATIVE": "1"}, tmp_path)
    assert out.returncode == 0, _summary(out)
    assert " passed" in out.stdout and " failed" not in out.stdout


def _sanitizer_build(tmp_path: Path) -> tuple[Path, str]:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed")
    runtimes = [
        subprocess.run([gcc, f"-print-file-name={lib}"], capture_output=True, text=True, check=True).stdout.strip()
        for lib in ("libasan.so", "libubsan.so")
    ]
    if not all(os.path.isabs(r) for r in runtimes):
        pytest.skip(f"gcc has no sanitizer runtimes here ({runtimes})")
    so = tmp_path / "_native_asan.so"
    subprocess.run(
        [gcc, "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g", "-O1",
         "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(ROOT / "transfer" / "_native.c"),
         "-o", str(so)],
        check=True, timeout=120,
    )  # fmt: skip
    return so, ":".join(runtimes)


def test_the_native_loops_are_clean_under_address_sanitizer(tmp_path: Path) -> None:
    so, preload = _sanitizer_build(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {
        "LD_PRELOAD": preload,
        "ASAN_OPTIONS": f"detect_leaks=0:abort_on_error=1:log_path={logs}/asan",
        "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:log_path={logs}/ubsan",
        "KVSTORE_NATIVE_PATH": str(so),
    }
    fuzzed = subprocess.run(
        [sys.executable, "-m", "bench.fuzz_native", "--inputs", "500", "--seed", "21"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert fuzzed.returncode == 0, _summary(fuzzed)
    line = json.loads(fuzzed.stdout.strip().splitlines()[-1])
    assert line["native"] == f"loaded from {so}", line  # the sanitized build ran, not the installed one
    assert line["inputs"] == 500 and line["mismatches"] == 0, line
    tests = _pytest(env, tmp_path)
    assert tests.returncode == 0, _summary(tests)
    assert not list(logs.iterdir()), [p.read_text()[:2000] for p in logs.iterdir()]

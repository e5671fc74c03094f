"""Processes a client or a tool starts (a Mooncake segment's daemon, a local cluster's master and
daemons): tied to their parent, and stopped the one way."""

from __future__ import annotations

import ctypes
import signal
import subprocess
from typing import Any


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """A ``preexec_fn``: the child gets SIGTERM when the thread that started it ends (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a crashed parent takes its children with it


def terminate(proc: subprocess.Popen[Any] | None, timeout_s: float) -> None:
    """Stop ``proc`` with SIGTERM (its clean stop), and SIGKILL if it is not gone within ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)

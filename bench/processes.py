"""The benches' child processes (vLLM engines and servers, the conductor, LMCache's server): each in
a process group of its own, its output in a log, stopped with whatever it started.

vLLM starts an engine-core process and workers of its own; a bench that stopped only the process
it started would leave those running (and holding memory and ports) when it fails. A process
group of its own lets :meth:`GroupProcess.stop` end them all.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self
from urllib.parse import urlsplit


class GroupProcess:
    """A child process in a process group of its own, its output in a log file.

    Starts on construction. Its stdout and stderr go to the log, or, with ``pipes``, its stdin and
    stdout are text pipes to the caller (:attr:`proc`) and only its stderr goes to the log.
    :meth:`stop` ends it and then its group (what it started and left behind), and closes the log;
    it may be called again (it does nothing more), and leaving a ``with`` block calls it.
    """

    def __init__(
        self, args: Sequence[str], log: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
        pipes: bool = False,
    ) -> None:  # fmt: skip
        self.log_path = log
        self._log: IO[str] = log.open("w")
        try:
            if pipes:
                self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                             text=True, env=env, cwd=cwd, start_new_session=True)  # fmt: skip
            else:
                self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env,
                                             cwd=cwd, start_new_session=True)  # fmt: skip
        except BaseException:
            self._log.close()
            raise

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log."""
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_http(self, url: str, timeout_s: float, what: str, *, interval_s: float = 0.5) -> None:
        """Until a GET of ``url`` (on loopback: ``http://host:port/path``) answers 200; RuntimeError,
        with the log's tail, when the process exits first or ``timeout_s`` passes."""
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.tail()}")
            conn = http.client.HTTPConnection(host, port, timeout=2)
            try:
                conn.request("GET", path)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(interval_s)
        raise RuntimeError(f"{what} did not answer {path} in {timeout_s} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 30.0, ask: Callable[[], object] | None = None) -> None:
        """End the process: ``ask`` it to (default: SIGTERM), wait ``timeout_s``, then SIGKILL it
        (at once when asking fails with a broken pipe); then SIGKILL its group, and close the pipes
        and the log."""
        if self.proc.poll() is None:
            try:
                (ask or self.proc.terminate)()
                self.proc.wait(timeout_s)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(10)
        self.kill_group()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a command still buffered for a reader that is gone
                    pipe.close()
        self._log.close()

    def kill_group(self) -> None:
        """SIGKILL every process left in the group (the process itself included, if it still runs)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

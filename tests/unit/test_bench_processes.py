"""bench.processes.GroupProcess on real child processes: stopped (asked, then killed), its group
killed with what it left behind, its log, and the wait for an HTTP answer."""

from __future__ import annotations

import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.processes import GroupProcess

PY = sys.executable

SLEEPS = "import time; print('up', flush=True); time.sleep(120)"

DEAF = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1:] == ["no-stdin"]:
    os.close(0)
print("up", flush=True)
time.sleep(120)
"""
"""A child that ignores SIGTERM (and, with ``no-stdin``, reads no command: writes to it break)."""

SPAWNS = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("grandchild", child.pid, flush=True)
time.sleep(float(sys.argv[1]))
"""
"""A child that starts a grandchild (in its process group, as Popen does by default), says its
pid, then sleeps ``argv[1]`` seconds and exits, leaving the grandchild behind."""

ECHO = """
import sys
sys.stderr.write("to the log\\n")
sys.stderr.flush()
for line in sys.stdin:
    if line.strip() == "quit":
        break
    print("@@" + line.strip(), flush=True)
"""
"""Answers each command line on stdout until ``quit``, as bench.vllm_engine does."""


def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def gone(pid: int) -> bool:
    """Whether ``pid`` is dead; a zombie counts (killed, waiting for whoever adopted it to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def grandchild(p: GroupProcess) -> int:
    assert until(lambda: "grandchild" in p.tail()), p.tail()
    return int(p.tail().split("grandchild ")[1].split()[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def send(p: GroupProcess, line: str) -> None:
    assert p.proc.stdin is not None
    p.proc.stdin.write(line)
    p.proc.stdin.flush()


def test_stop_ends_it_with_sigterm_and_may_be_called_again(tmp_path: Path) -> None:
    with GroupProcess([PY, "-c", SLEEPS], tmp_path / "a.log") as p:
        assert until(lambda: "up" in p.tail())
        assert p.proc.poll() is None
    assert p.proc.returncode == -signal.SIGTERM
    p.stop()  # nothing more to do
    assert p.tail() == "up"  # the log stays readable


def test_stop_kills_what_does_not_end_on_sigterm_after_the_timeout(tmp_path: Path) -> None:
    p = GroupProcess([PY, "-c", DEAF], tmp_path / "a.log")
    assert until(lambda: "up" in p.tail())  # SIGTERM is ignored from now on
    started = time.monotonic()
    p.stop(timeout_s=0.5)
    assert p.proc.returncode == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - started < 10


@pytest.mark.parametrize("child_s", [0.0, 120.0], ids=["child-exited", "child-running"])
def test_stop_kills_the_group_with_what_the_process_started(tmp_path: Path, child_s: float) -> None:
    p = GroupProcess([PY, "-c", SPAWNS, str(child_s)], tmp_path / "a.log")
    pid = grandchild(p)
    if child_s == 0.0:
        assert until(lambda: p.proc.poll() is not None)
    time.sleep(0.2)
    assert not gone(pid)  # the child's exit, or a SIGTERM to the child alone, leaves it running
    p.stop()
    assert until(lambda: gone(pid), 5.0), f"the grandchild {pid} outlived stop()"


def test_kill_group_kills_the_process_and_its_grandchild(tmp_path: Path) -> None:
    p = GroupProcess([PY, "-c", SPAWNS, "120"], tmp_path / "a.log")
    pid = grandchild(p)
    p.kill_group()
    assert p.proc.wait(5) == -signal.SIGKILL
    assert until(lambda: gone(pid), 5.0)
    p.stop()


def test_the_log_holds_stdout_and_stderr_and_tail_gives_its_last_lines(tmp_path: Path) -> None:
    script = "import sys\nfor i in range(50): print(i, flush=True)\nsys.stderr.write('on stderr\\n')"
    with GroupProcess([PY, "-c", script], tmp_path / "a.log") as p:
        assert p.proc.wait(30) == 0
        assert p.tail(3) == "48\n49\non stderr"
        assert p.tail().splitlines()[0] == "11"  # 40 lines by default
    assert (tmp_path / "a.log").read_text().splitlines()[0] == "0"


def test_pipes_carry_commands_and_answers_and_stop_asks_first(tmp_path: Path) -> None:
    p = GroupProcess([PY, "-c", ECHO], tmp_path / "a.log", pipes=True)
    assert p.proc.stdin is not None and p.proc.stdout is not None
    send(p, "hello\n")
    assert p.proc.stdout.readline() == "@@hello\n"
    p.stop(timeout_s=30, ask=lambda: send(p, "quit\n"))
    assert p.proc.returncode == 0  # it left when asked: no signal
    assert p.proc.stdin.closed and p.proc.stdout.closed
    assert "to the log" in p.tail()


def test_stop_kills_at_once_when_asking_finds_the_pipe_broken(tmp_path: Path) -> None:
    p = GroupProcess([PY, "-c", DEAF, "no-stdin"], tmp_path / "a.log", pipes=True)
    assert p.proc.stdout is not None and p.proc.stdout.readline() == "up\n"
    started = time.monotonic()
    p.stop(timeout_s=60, ask=lambda: send(p, "quit\n"))  # nobody reads it: BrokenPipeError
    assert p.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10  # not the 60 s of the timeout


def test_wait_http_returns_once_the_url_answers_200(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "health").write_text("ok")
    server = [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with GroupProcess(server, tmp_path / "server.log", cwd=tmp_path) as p:
        p.wait_http(f"http://127.0.0.1:{port}/health", 30, "http.server", interval_s=0.05)
        with pytest.raises(RuntimeError, match=r"^http.server did not answer /missing in 0.5 s"):
            p.wait_http(f"http://127.0.0.1:{port}/missing", 0.5, "http.server", interval_s=0.05)  # 404: no answer
    assert "GET /health" in p.tail()


def test_wait_http_times_out_with_the_logs_tail(tmp_path: Path) -> None:
    port = free_port()  # nobody listens there
    with GroupProcess([PY, "-c", SLEEPS], tmp_path / "a.log") as p:
        assert until(lambda: "up" in p.tail())
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"the server did not answer /health in 0.5 s:\nup$"):
            p.wait_http(f"http://127.0.0.1:{port}/health", 0.5, "the server", interval_s=0.05)
        assert time.monotonic() - started < 5
        assert p.proc.poll() is None


def test_wait_http_fails_when_the_process_exits_first(tmp_path: Path) -> None:
    script = "print('no config'); raise SystemExit(3)"
    with (
        GroupProcess([PY, "-c", script], tmp_path / "a.log") as p,
        pytest.raises(RuntimeError, match=r"the server exited with 3:\nno config$"),
    ):
        p.wait_http(f"http://127.0.0.1:{free_port()}/health", 30, "the server", interval_s=0.05)

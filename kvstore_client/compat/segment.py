"""A Mooncake client's segment: the DRAM it gives the pool, served by a daemon it starts.

A Mooncake client with ``global_segment_size`` > 0 mounts that much of its own memory into the
cluster's pool, and unmounts it (losing the objects held only there) when it closes. Here the
client starts a ``kvstore daemon --leave-on-exit`` on its host at setup and stops it at close;
the daemon then has the master forget its node and deletes its arena. The client and the
server never import each other (DESIGN.md), so the daemon is a process, stopped with its parent.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore.errors import ConnectionFailed, InvalidArgument, KVStoreError, Timeout
from kvstore_client.children import die_with_parent, terminate
from kvstore_client.store import Store

PORTS = range(12300, 14301)
"""Where a client whose hostname names no port serves its segment (Mooncake's range)."""
_START_ATTEMPTS = 20
_MIN_SEGMENT = 1 << 20
"""A smaller segment is rounded up to this: a daemon's arena needs room for its index."""


def node_id(segment_name: str) -> str:
    """The node id of a segment ``host:port`` (node ids have no ':')."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", segment_name)[:64]


def split_hostname(local_hostname: str) -> tuple[str, int | None]:
    """(host, port) of a Mooncake ``local_hostname``: ``host``, ``host:port`` or ``[v6]:port``."""
    host, port = local_hostname, None
    if local_hostname.startswith("["):
        host, _, rest = local_hostname[1:].partition("]")
        if rest.startswith(":"):
            port = rest[1:]
    elif local_hostname.count(":") == 1:
        host, port = local_hostname.split(":")
    if not host or (port is not None and (not port.isdigit() or not 0 < int(port) < 65536)):
        raise InvalidArgument(f"local_hostname {local_hostname!r} is not host or host:port")
    return host, int(port) if port is not None else None


class Segment:
    """A daemon serving ``size`` bytes of DRAM as node ``name`` (see the module docstring)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], workdir: Path) -> None:
        self.name = name
        self.node_id = node_id(name)
        self.proc = proc
        self.workdir = workdir

    @classmethod
    def start(cls, store: Store, master: str, host: str, port: int | None, size: int, timeout_s: float) -> Segment:
        """Start the daemon on ``host:port`` (a free port of :data:`PORTS` when None) and return once
        the master counts its node up; raises ConnectionFailed or Timeout naming what went wrong."""
        try:
            address = socket.gethostbyname(host)
        except OSError as exc:
            raise InvalidArgument(f"local_hostname {host!r} does not resolve: {exc}") from None
        ports = [port] if port is not None else random.sample(PORTS, _START_ATTEMPTS)
        failure = ""
        for candidate in ports:
            if port is None and not _free(address, candidate):
                continue
            workdir = Path(tempfile.mkdtemp(prefix="kvstore-segment-"))
            segment = cls._spawn(master, f"{host}:{candidate}", address, candidate, max(size, _MIN_SEGMENT), workdir)
            try:
                segment._wait(store, timeout_s)
                return segment
            except ConnectionFailed as exc:
                failure = str(exc)
                segment.stop()
                if "in use" not in failure:
                    raise
            except BaseException:
                segment.stop()
                raise
        raise ConnectionFailed(f"no free port for a segment on {host}: {failure or 'every port tried is taken'}")

    @classmethod
    def _spawn(cls, master: str, name: str, address: str, port: int, size: int, workdir: Path) -> Segment:
        # The segment's memory is reserved at start (no SIGBUS later); not touching every page of it
        # spares the start-up time.
        env = {**os.environ, "KVSTORE_DAEMON_DRAM__PREFAULT": "false"}
        args = [
            sys.executable, "-m", "kvstore_cli", "daemon", "--master", master, "--name", node_id(name),
            "--host", address, "--port", str(port), "--dram", str(size), "--leave-on-exit",
        ]  # fmt: skip
        with open(workdir / "daemon.log", "wb") as log:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        return cls(name, proc, workdir)

    def _wait(self, store: Store, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConnectionFailed(f"the daemon of segment {self.name} exited at start: {self.log_tail()}")
            with contextlib.suppress(KVStoreError):
                if any(n.node_id == self.node_id and n.up for n in store.nodes()):
                    return
            time.sleep(0.05)
        raise Timeout(f"the daemon of segment {self.name} did not register within {timeout_s:.0f} s")

    def log_tail(self) -> str:
        try:
            text = (self.workdir / "daemon.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-1500:].strip() or "(empty log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the daemon: it has the master forget its node, and deletes its arena."""
        terminate(self.proc, timeout_s)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True

"""Two hosts on one machine: network namespaces joined by rate-limited veth links, like NICs.

Host ``a`` and host ``b`` get ``links`` veth pairs, link ``i`` on subnet
10.<net>.<i>.0/24 (a = .1, b = .2), each shaped by a tbf qdisc on both ends.
Used by the netns tests and by ``bench.transfer``; needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field


def stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class NetnsUnavailable(Exception):
    """This machine does not let us make namespaces (not root, no iproute2, or forbidden)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsUnavailable(f"tc {' '.join(args)} in {ns}: {done.stderr.strip()}")


@dataclass
class TwoHosts:
    links: int = 2
    rate: str = "200mbit"
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}")
    net: int = field(default_factory=lambda: 100 + os.getpid() % 100)

    @property
    def a(self) -> str:
        return f"kvs{self.tag}a"

    @property
    def b(self) -> str:
        return f"kvs{self.tag}b"

    def dev(self, side: str, i: int) -> str:
        return f"kvs{self.tag}{side}{i}"

    def address(self, side: str, i: int) -> str:
        return f"10.{self.net}.{i}.{1 if side == 'a' else 2}"

    def up(self) -> TwoHosts:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            raise NetnsUnavailable("network namespaces need root and iproute2 (ip, tc)")
        try:
            _ip("netns", "add", self.a)
            _ip("netns", "add", self.b)
            for ns in (self.a, self.b):
                _ip("-n", ns, "link", "set", "lo", "up")
            for i in range(1, self.links + 1):
                _ip("link", "add", self.dev("a", i), "netns", self.a, "type", "veth",
                    "peer", "name", self.dev("b", i), "netns", self.b)  # fmt: skip
                for side, ns in (("a", self.a), ("b", self.b)):
                    _ip("-n", ns, "addr", "add", f"{self.address(side, i)}/24", "dev", self.dev(side, i))
                    _ip("-n", ns, "link", "set", self.dev(side, i), "up")
                    _tc(ns, "qdisc", "add", "dev", self.dev(side, i), "root", "tbf",
                        "rate", self.rate, "burst", "64kb", "latency", "100ms")  # fmt: skip
        except BaseException:
            self.down()
            raise
        return self

    def set_link(self, side: str, i: int, state: str) -> None:
        _ip("-n", self.a if side == "a" else self.b, "link", "set", self.dev(side, i), state)

    def tx_bytes(self, side: str, i: int) -> int:
        ns = self.a if side == "a" else self.b
        path = f"/sys/class/net/{self.dev(side, i)}/statistics/tx_bytes"
        done = subprocess.run(["ip", "netns", "exec", ns, "cat", path], capture_output=True, text=True, timeout=10)
        return int(done.stdout.strip() or 0)

    def exec_args(self, side: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``side``'s namespace."""
        return ["ip", "netns", "exec", self.a if side == "a" else self.b, *argv]

    def start_store(self, workdir: str, dram: str = "128MiB") -> tuple[str, list[subprocess.Popen[str]]]:
        """A master and one daemon in host ``b``, the daemon serving a rail on every link; the master's address."""
        procs: list[subprocess.Popen[str]] = []
        try:
            master = subprocess.Popen(
                self.exec_args("b", [sys.executable, "-m", "kvstore_cli", "master",
                                     "--host", self.address("b", 1), "--port", "0"]),
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            procs.append(master)
            assert master.stdout is not None
            address = master.stdout.readline().strip().rsplit(" ", 1)[-1]
            if ":" not in address:
                raise NetnsUnavailable("the master in the namespace did not start")
            rails = [arg for i in range(2, self.links + 1) for arg in ("--rail", self.address("b", i))]
            daemon = subprocess.Popen(
                self.exec_args("b", [sys.executable, "-m", "kvstore_cli", "daemon", "--master", address,
                                     "--name", f"netns{self.tag}", "--dram", dram, "--host", self.address("b", 1),
                                     *rails]),
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            procs.append(daemon)
            assert daemon.stdout is not None
            daemon.stdout.readline()
            return address, procs
        except BaseException:
            stop(procs)
            raise

    def down(self) -> None:
        """Remove both namespaces (their veth links go with them); quiet when they are already gone."""
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        # The daemon's arena outlives it by design; these hosts are gone, so is it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/kvstore-netns{self.tag}.arena")

    def __enter__(self) -> TwoHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

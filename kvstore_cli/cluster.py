"""A real local cluster: one master and N daemons as separate processes on loopback (and, for HA
masters, a one-member etcd: :class:`LocalEtcd`).

Used by ``kvstore cluster up``, the demo, the benchmarks and the tests. Each
process is this command line's ``master`` or ``daemon`` command, started with
this Python and stopped in reverse order; the daemons' arenas and SSD
directories live under a work directory that is removed afterwards unless it
was given by the caller. It lives with the command line, not in ``server``:
it spawns the command line's own commands, and it imports neither the server
nor the client (readiness is one protocol call to the master).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Literal, Self

from kvstore.auth import cluster_credential, read_secret_file
from kvstore.config import ClientConfig, TlsConfig, daemon_dram
from kvstore.errors import ConnectionFailed, InvalidArgument, KVStoreError, Timeout
from kvstore.protocol import Stats, StatsReply
from kvstore.tenants import OPERATIONS, add_admin, add_tenant
from kvstore.tiers.dram import DramArena
from kvstore_cli.certs import CertFiles, make_certs
from kvstore_client.children import die_with_parent, terminate
from transfer.discovery import EtcdCluster, MasterLocator, read_leader
from transfer.rpc import Connection
from transfer.tls import contexts

_START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """A one-member etcd on loopback (Debian's ``etcd-server``), its data kept across restarts, for
    HA masters (``LocalCluster(etcd=LocalEtcd().start().endpoint, masters=2)``)."""

    def __init__(self, workdir: Path | None = None) -> None:
        self._own_dir = workdir is None
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="kvstore-etcd-"))
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> Self:
        """Start it and wait until it answers (a read of a leader key: none yet is an answer)."""
        if shutil.which("etcd") is None:
            raise ConnectionFailed("etcd is not installed (Debian: apt install etcd-server)")
        peer, client = f"http://127.0.0.1:{self.peer_port}", f"http://{self.endpoint}"
        args = [
            "etcd", "--name", "local", "--data-dir", str(self.dir / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"local={peer}",
            # Leases of 1 s (etcd's least is 1.5 election timeouts): a dead leader is replaced within it.
            "--election-timeout", "500", "--heartbeat-interval", "50",
            # The masters rewrite a few keys (a node's drops) again and again: old revisions go after 5 minutes.
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m",
        ]  # fmt: skip
        with open(self.dir / "etcd.log", "a") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                read_leader(EtcdCluster((self.endpoint,), "kvstore"), 1.0)
                return self
            except ConnectionFailed:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ConnectionFailed(f"etcd did not start on {self.endpoint} (see {self.dir}/etcd.log)") from None
                time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)
            self.proc = None

    def remove(self) -> None:
        """Stop it and delete its data (a directory it made itself)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _read_line(stream: IO[str], timeout: float, what: str) -> str:
    """One line from a child's stdout, within ``timeout``.

    Read from the descriptor a byte at a time, not through ``stream``: its buffer would swallow a
    second line that came in the same read, and a later select on the descriptor would then wait
    for a line that had already arrived.
    """
    fd = stream.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise Timeout(f"{what} did not report its address within {timeout:.0f} s")
        byte = os.read(fd, 1)
        if not byte:
            raise ConnectionFailed(f"{what} exited before reporting its address")
        line += byte
    return line.decode().strip()


class LocalCluster:
    def __init__(
        self,
        daemons: int = 2,
        *,
        dram: str | int = "64MiB",
        ssd: str | int = 0,
        workdir: Path | None = None,
        master_port: int = 0,
        master_args: tuple[str, ...] = (),
        daemon_args: tuple[str, ...] = (),
        admin: bool = False,
        admin_port: int = 0,
        env: dict[str, str] | None = None,
        etcd: str | None = None,
        cluster_id: str = "kvstore",
        masters: int = 1,
        authenticate: bool = False,
        tls: bool = False,
        tls_data: bool = False,
        die_with_parent: bool = False,
        groups: int | None = None,
        daemon_metrics: bool = False,
        kv_events: bool = False,
    ) -> None:
        """``etcd``: run ``masters`` HA masters electing a leader in that etcd (host:port[,...]);
        clients and daemons then reach the leader at :attr:`master_address`, an etcd:// URL.
        ``authenticate``: a new cluster secret (in :attr:`secret_file`) and a tenants file
        (:attr:`tenants_file`, filled by :meth:`add_tenant`): every connection authenticates.
        ``tls``: a new CA and a certificate for 127.0.0.1 (:attr:`certs`); RPC and the admin API run
        over TLS, and with ``tls_data`` the daemons' ports too. ``die_with_parent``: every process
        gets SIGTERM when the thread that started it ends, however it ends (SIGKILL included).
        ``groups`` (root only): each process runs with a group id of its own, master ``m`` ``groups + m``
        and daemon ``i`` ``groups + 8 + i`` (:meth:`gid`), so that a firewall's owner match can tell
        their packets apart on loopback (``bench.chaos``'s partitions). ``daemon_metrics``: each daemon
        serves its Prometheus metrics (at :attr:`daemon_metrics`, host:port; kept across restarts).
        ``kv_events``: each master publishes KV events, at :attr:`kv_events` (its PUB and replay endpoints)."""
        self.die_with_parent = die_with_parent and sys.platform == "linux"
        if groups is not None and (os.geteuid() != 0 or max(masters, daemons) > 8):
            raise InvalidArgument(
                "groups: a group of its own for each process needs root, and 8 masters and daemons at most; got"
                f" {masters} masters and {daemons} daemons as uid {os.geteuid()}"
            )
        self.groups = groups
        self.etcd = etcd
        self.cluster_id = cluster_id
        self.masters: list[subprocess.Popen[str] | None] = [None] * (masters if etcd else 1)
        self.master_rpc: list[str] = [""] * len(self.masters)
        """Each master's own host:port (HA: leader or standby)."""
        self.master_admin: list[str] = [""] * len(self.masters)
        """Each HA master's admin API host:port (with ``admin=True``)."""
        self.kv_events: list[tuple[str, str]] = [("", "")] * len(self.masters)
        """Each master's KV events endpoints, (publish, replay) (with ``kv_events=True``)."""
        if kv_events:
            master_args = ("--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*", *master_args)
        self.num_daemons = daemons
        self.dram, self.ssd = str(dram), str(ssd)
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="kvstore-cluster-"))
        self.tag = f"{os.getpid()}-{int(time.time() * 1000) % 1_000_000}"
        self.master_port = master_port
        self.master_args = master_args
        self.daemon_args = daemon_args
        self.admin = admin
        self.admin_port = admin_port
        self.admin_address = ""
        """host:port of the master's REST admin API and dashboard (with ``admin=True``)."""
        self.env = {**os.environ, **(env or {})}
        self.master_address = ""
        self.master: subprocess.Popen[str] | None = None
        self.daemons: list[subprocess.Popen[str] | None] = [None] * daemons
        self.daemon_addresses: list[str] = [""] * daemons
        self.serve_metrics = daemon_metrics
        self.daemon_metrics: list[str] = [""] * daemons
        """Each daemon's metrics host:port (with ``daemon_metrics=True``)."""
        self.secret_file: Path | None = None
        self.tenants_file: Path | None = None
        if authenticate:
            self.secret_file = self.workdir / "cluster.secret"
            self.secret_file.write_text(secrets.token_urlsafe(32))
            self.secret_file.chmod(0o600)
            self.tenants_file = self.workdir / "tenants.toml"
            self.tenants_file.write_text("")
            auth = ("--cluster-secret-file", str(self.secret_file))
            self.master_args = (*auth, "--tenants", str(self.tenants_file), *self.master_args)
            self.daemon_args = (*auth, *self.daemon_args)
        self.certs: CertFiles | None = None
        self.tls_data = tls_data
        if tls or tls_data:
            self.certs = make_certs(self.workdir / "tls", "cluster", ["127.0.0.1", "localhost"])
            flags = ("--tls-cert", str(self.certs.cert), "--tls-key", str(self.certs.key),
                     "--tls-ca", str(self.certs.ca), *(("--tls-data",) if tls_data else ()))  # fmt: skip
            self.master_args = (*flags, *self.master_args)
            self.daemon_args = (*flags, *self.daemon_args)

    def add_tenant(self, name: str, quota: int = 0, operations: tuple[str, ...] = OPERATIONS) -> str:
        """Add a tenant to the cluster's tenants file (the master reads it at the next connection) and
        return its token."""
        assert self.tenants_file is not None, "a cluster started with authenticate=True"
        return add_tenant(self.tenants_file, name, quota, operations)

    def add_admin(self, name: str, role: str = "read-only") -> str:
        """Add an admin API token of ``role`` to the tenants file and return it."""
        assert self.tenants_file is not None, "a cluster started with authenticate=True"
        return add_admin(self.tenants_file, name, role)

    def client_config(self, **fields: object) -> ClientConfig:
        """A client config of the cluster itself (its secret, when it authenticates)."""
        secret = {"cluster_secret_file": str(self.secret_file)} if self.secret_file is not None else {}
        tls = {"tls": self.tls_config()} if self.certs is not None and "tls" not in fields else {}
        return ClientConfig(**secret, **tls, **fields)  # type: ignore[arg-type]

    def tls_config(self) -> TlsConfig | None:
        """What a client of this cluster needs for its TLS (its CA; the certificate, for client certificates)."""
        return self.certs.config(data_plane=self.tls_data) if self.certs is not None else None

    def gid(self, role: Literal["master", "daemon"], i: int) -> int | None:
        """The group id the ``role`` (master or daemon) ``i`` runs with (None: the caller's)."""
        if self.groups is None:
            return None
        if role not in ("master", "daemon") or not 0 <= i < 8:
            raise InvalidArgument(f"no group for {role} {i}: masters and daemons 0 to 7 have one")
        return self.groups + i + (8 if role == "daemon" else 0)

    def _spawn(self, args: list[str], log_name: str, gid: int | None = None) -> subprocess.Popen[str]:
        log = open(self.workdir / log_name, "a")  # noqa: SIM115 - owned by the child
        return subprocess.Popen(
            [sys.executable, "-m", "kvstore_cli", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=self.env,
            start_new_session=True,
            preexec_fn=die_with_parent if self.die_with_parent else None,
            group=gid,
        )

    def node_name(self, i: int) -> str:
        return f"node{i}"

    def arena_name(self, i: int) -> str:
        return f"cluster-{self.tag}-{i}"

    def start(self) -> Self:
        try:
            if self.etcd is None:
                self.start_master()
            else:
                for m in range(len(self.masters)):
                    self.start_ha_master(m)
                self.master_address = f"etcd://{self.etcd}/{self.cluster_id}"
            for i in range(self.num_daemons):
                self.start_daemon(i)
            self.wait_for_nodes(self.num_daemons)
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        port = self.master_port or 0
        admin = ["--admin-port", self.admin_address.rsplit(":", 1)[1] if self.admin_address else str(self.admin_port)]
        args = ["master", "--port", str(port), *(admin if self.admin else []), *self.master_args]
        self.master = self._spawn(args, "master.log", self.gid("master", 0))
        assert self.master.stdout is not None
        line = _read_line(self.master.stdout, _START_TIMEOUT, "the master")
        self.master_address = line.rsplit(" ", 1)[-1]
        self._read_events(0, self.master.stdout)
        if self.admin:
            line = _read_line(self.master.stdout, _START_TIMEOUT, "the master's admin API")
            self.admin_address = line.rsplit("//", 1)[-1]
        self.master_port = int(self.master_address.rsplit(":", 1)[1])

    def start_ha_master(self, m: int) -> None:
        """Start HA master ``m`` (on its former port when it ran before); it campaigns in etcd."""
        port = self.master_rpc[m].rsplit(":", 1)[1] if self.master_rpc[m] else "0"
        admin = ["--admin-port", self.master_admin[m].rsplit(":", 1)[1] if self.master_admin[m] else "0"]
        args = [
            "master", "--port", port, "--etcd", str(self.etcd), "--cluster-id", self.cluster_id,
            *(admin if self.admin else []), *self.master_args,
        ]  # fmt: skip
        proc = self._spawn(args, f"master-{m}.log", self.gid("master", m))
        self.masters[m] = proc
        assert proc.stdout is not None
        line = _read_line(proc.stdout, _START_TIMEOUT, f"master {m}")
        self.master_rpc[m] = line.rsplit(" ", 1)[-1]
        self._read_events(m, proc.stdout)
        if self.admin:
            self.master_admin[m] = _read_line(proc.stdout, _START_TIMEOUT, f"master {m}'s admin API").rsplit("//")[-1]
        if m == 0:
            self.master = proc
            self.admin_address = self.master_admin[0]

    def _read_events(self, m: int, stdout: IO[str]) -> None:
        """Master ``m``'s KV events endpoints, from the line it prints after its address."""
        if "--kv-events" not in self.master_args:
            return
        line = _read_line(stdout, _START_TIMEOUT, f"master {m}'s KV events")
        pub, _, replay = line.removeprefix("kvstore KV events on ").partition(", replay on ")
        self.kv_events[m] = (pub, replay)

    def leader_index(self, timeout: float = 15.0) -> int:
        """The index of the running HA master etcd names as leader (waiting for an election to end)."""
        assert self.etcd is not None, "a cluster started with etcd"
        where = EtcdCluster((self.etcd,), self.cluster_id)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(KVStoreError):  # etcd restarting: ask again
                leader = read_leader(where, 1.0)
                if leader is not None and leader.address in self.master_rpc:
                    m = self.master_rpc.index(leader.address)
                    if self.masters[m] is not None:
                        return m
            if time.monotonic() > deadline:
                raise Timeout(f"no leader of cluster {self.cluster_id} elected within {timeout:.0f} s")
            time.sleep(0.05)

    def kill_ha_master(self, m: int, sig: int = signal.SIGKILL) -> None:
        self._kill(self.masters[m], sig)
        self.masters[m] = None

    def start_daemon(self, i: int) -> None:
        """Start daemon ``i``; a restart keeps its port, as a daemon in production keeps its address."""
        port = self.daemon_addresses[i].rsplit(":", 1)[1] if self.daemon_addresses[i] else "0"
        metrics = ["--metrics-port", self.daemon_metrics[i].rsplit(":", 1)[1] if self.daemon_metrics[i] else "0"]
        args = [
            "daemon", "--master", self.master_address, "--name", self.node_name(i), "--arena", self.arena_name(i),
            "--dram", self.dram, "--ssd", self.ssd, "--ssd-dir", str(self.workdir / f"ssd-{i}"), "--port", port,
            *(metrics if self.serve_metrics else []), *self.daemon_args,
        ]  # fmt: skip
        proc = self._spawn(args, f"daemon-{i}.log", self.gid("daemon", i))
        self.daemons[i] = proc  # from now on stop() ends it, whatever happens next
        assert proc.stdout is not None
        line = _read_line(proc.stdout, _START_TIMEOUT, f"daemon {i}")
        self.daemon_addresses[i] = line.rsplit(" ", 1)[-1]
        if self.serve_metrics:
            line = _read_line(proc.stdout, _START_TIMEOUT, f"daemon {i}'s metrics")
            self.daemon_metrics[i] = line.rsplit("//", 1)[-1].removesuffix("/metrics")

    def wait_for_nodes(self, count: int, timeout: float = _START_TIMEOUT) -> None:
        """Wait until the master counts ``count`` nodes up; an unreachable master is asked again until ``timeout``."""
        deadline = time.monotonic() + timeout
        credential = cluster_credential(read_secret_file(self.secret_file)) if self.secret_file is not None else None
        to_master = contexts(self.tls_config())[0]
        conn = Connection(MasterLocator(self.master_address), min(timeout, 5.0), credential, to_master)
        try:
            while True:
                try:
                    if conn.call(Stats(), StatsReply).stats.get("nodes_up", 0) >= count:
                        return
                except KVStoreError:
                    pass
                if time.monotonic() > deadline:
                    raise Timeout(f"{count} daemons did not register within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            conn.close()

    # -- faults, for tests ---------------------------------------------------------------
    @staticmethod
    def _kill(proc: subprocess.Popen[str] | None, sig: int) -> None:
        if proc is not None:
            proc.send_signal(sig)
            proc.wait(timeout=10)

    def kill_daemon(self, i: int, sig: int = signal.SIGKILL) -> None:
        self._kill(self.daemons[i], sig)
        self.daemons[i] = None

    def kill_master(self, sig: int = signal.SIGKILL) -> None:
        self._kill(self.master, sig)
        self.master = None

    def log_tail(self, i: int, lines: int = 10) -> str:
        """The last lines daemon ``i`` wrote to its log (why it died, when it did)."""
        try:
            text = (self.workdir / f"daemon-{i}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def restart_daemon(self, i: int) -> None:
        """Start daemon ``i`` again with the same name, arena and SSD directory, and wait for it to register
        (with the other daemons that are running)."""
        self.start_daemon(i)
        self.wait_for_nodes(sum(p is not None and p.poll() is None for p in self.daemons))

    def restart_master(self) -> None:
        """Start a fresh master on the same port; the daemons re-register with it."""
        self.start_master()
        self.wait_for_nodes(sum(p is not None for p in self.daemons))

    # -- teardown --------------------------------------------------------------------------
    def stop(self) -> None:
        for i, proc in enumerate(self.daemons):
            terminate(proc, 10)
            self.daemons[i] = None
        terminate(self.master, 10)
        self.master = None
        for m, proc in enumerate(self.masters):
            terminate(proc, 10)
            self.masters[m] = None
        for i in range(self.num_daemons):  # where the daemons put them (KVSTORE_DAEMON_DRAM__SHM_DIR too)
            DramArena.remove(daemon_dram(self.env, name=self.arena_name(i)))
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

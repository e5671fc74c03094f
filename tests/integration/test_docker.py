"""The images and the compose cluster of docker/, built and run here (marker ``docker``).

Nothing comes from Docker Hub: the base image is built from Debian packages with mmdebstrap and
imported, cached under a tag that names its inputs (suite, mirror, packages, the CA bundle pip uses
here), so re-runs skip it; the kvstore and etcd images are built FROM it with the host's network,
pip's index and that CA bundle (the base's trust store). docker/compose.yaml then brings up etcd,
two masters and two daemons under a project name of this run, on ports free here. From the host:
``kvstore status`` through etcd, the leader's dashboard and ``/metrics``, puts and gets with
``Store``. A daemon's container is then killed twice, once with ``docker kill`` (then started
again) and once by a SIGKILL from outside Docker that the restart policy answers: its blocks read
as misses, never other bytes, the other daemon's as hits, and once put again, hits.

Figures (build times, image sizes, seconds to healthy) go to the output (``pytest -s``). It skips,
saying why, where no Docker daemon can run; it starts ``dockerd`` when that is installed and not
running and the test runs as root (without a bridge, iptables rules or IP forwarding, so the host's
network stays as it was), and stops it after. ``KVSTORE_DOCKER_BASE=python:3.12-slim``
uses that base instead of building one; ``KVSTORE_DOCKER_MIRROR`` names the Debian mirror.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore_client import Store
from kvstore_client.children import terminate
from kvstore_client.store import PutOptions, PutStatus
from tests.conftest import admin_call
from transfer.discovery import EtcdCluster, read_leader

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
IMAGE = "kvstore-test:local"
BUILD_STAGE = "kvstore-test:build"
ETCD_IMAGE = "kvstore-test-etcd:local"
PROMETHEUS_IMAGE = "kvstore-test-prometheus:local"
# What the base holds: Debian's python3 and its venv module (docker/Dockerfile installs into a venv)
# and CA certificates; no man pages, docs or translations. Part of the cached base's tag.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
MMDEBSTRAP_OPTIONS = (
    "--variant=apt",  # apt stays: docker/etcd.Dockerfile installs etcd-server with it
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",  # else usrmerge, and perl with it
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
)
SERVICES = ("etcd", "master1", "master2", "node1", "node2", "prometheus")
BLOCK = 64 * 1024
NUM_BLOCKS = 40


def sh(*args: str, timeout: float, env: dict[str, str] | None = None, check: bool = True) -> str:
    """Run a command; its output (stdout and stderr together), or a failure that shows its tail."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(args)} did not end within {timeout} s") from exc
    out = done.stdout + done.stderr
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{out[-4000:]}")
    return out


def docker_answers() -> bool:
    try:
        return sh("docker", "info", "--format", "{{.ServerVersion}}", timeout=30, check=False).strip()[:1].isdigit()
    except AssertionError:
        return False


def compose_command() -> list[str] | None:
    """Debian's docker-compose (1.29), else the v2 plugin; None when neither is there."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    done = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False)
    return ["docker", "compose"] if done.returncode == 0 else None


@dataclass
class Docker:
    compose: list[str]

    @staticmethod
    def figure(name: str, value: str) -> None:
        print(f"[docker] {name}: {value}", flush=True)


def start_dockerd(log: Path) -> subprocess.Popen[bytes]:
    """Start dockerd and wait for it to answer; skip, with its log's tail, where it cannot run."""
    if shutil.which("dockerd") is None:
        pytest.skip("no Docker daemon answers and dockerd is not installed (Debian: apt install docker.io)")
    if os.geteuid() != 0:
        pytest.skip("no Docker daemon answers, and starting dockerd needs root")
    # Without a bridge, iptables rules or IP forwarding: every container here uses the host's network
    # or none, and the host's network is left as it was.
    argv = ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if docker_answers():
            return proc
        time.sleep(0.5)
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)
    tail = log.read_text(errors="replace")[-1500:]
    pytest.skip(f"dockerd cannot run here (exit {proc.returncode}); its log ends:\n{tail}")


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Docker]:
    if shutil.which("docker") is None:
        pytest.skip("no docker command (Debian: apt install docker.io)")
    compose = compose_command()
    if compose is None:
        pytest.skip("neither docker-compose nor the docker compose plugin (Debian: apt install docker-compose)")
    started = time.monotonic()
    dockerd = None if docker_answers() else start_dockerd(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    try:
        yield Docker(compose)
        Docker.figure("docker tests, in all", f"{time.monotonic() - started:.0f} s")
    finally:
        if dockerd is not None:  # ours: stop it as we found it (the images stay on disk)
            terminate(dockerd, 60)


# -- images -------------------------------------------------------------------------------------


def pip_settings() -> dict[str, str]:
    """pip's effective settings here by name (cert, index-url, ...), the environment's first."""
    out = sh(sys.executable, "-m", "pip", "config", "list", timeout=60, check=False)
    found: dict[str, str] = {}
    for line in sorted(out.splitlines(), key=lambda line: not line.startswith(":env:")):
        key, sep, value = line.partition("=")
        if sep:
            found.setdefault(key.rsplit(".", 1)[-1], value.strip().strip("'\""))
    for name in ("cert", "index-url", "extra-index-url"):
        var = "PIP_" + name.upper().replace("-", "_")
        if os.environ.get(var):
            found[name] = os.environ[var]
    return found


def ca_bundle(pip: dict[str, str]) -> Path | None:
    """The CA bundle pip trusts here: pip's cert setting, else what requests and ssl would use."""
    for candidate in (pip.get("cert"), os.environ.get("REQUESTS_CA_BUNDLE"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):  # fmt: skip
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def debian_suite() -> str:
    fields = dict(
        line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line
    )  # fmt: skip
    codename = fields.get("VERSION_CODENAME", "").strip('"')
    return codename if fields.get("ID") == "debian" and codename else "bookworm"


def image_id(tag: str) -> str | None:
    out = sh("docker", "image", "inspect", "--format", "{{.Id}}", tag, timeout=60, check=False).strip()
    return out if out.startswith("sha256:") else None


@pytest.fixture(scope="module")
def base_image(docker: Docker) -> str:
    """A Debian base with python3 and the CA bundle pip uses here, built once and kept by its tag."""
    given = os.environ.get("KVSTORE_DOCKER_BASE")
    if given:
        docker.figure("base image", f"{given} (KVSTORE_DOCKER_BASE)")
        return given
    suite = debian_suite()
    mirror = os.environ.get("KVSTORE_DOCKER_MIRROR", "http://deb.debian.org/debian")
    ca = ca_bundle(pip_settings())
    inputs = json.dumps([suite, mirror, BASE_PACKAGES, MMDEBSTRAP_OPTIONS]).encode()
    digest = hashlib.sha256(inputs + (ca.read_bytes() if ca else b"")).hexdigest()[:12]
    tag = f"kvstore-test-base:{suite}-{digest}"
    if image_id(tag):
        docker.figure("base image", f"{tag} (cached)")
        return tag
    if shutil.which("mmdebstrap") is None:
        pytest.skip("the base image is built with mmdebstrap, which is not installed (Debian: apt install mmdebstrap)")
    hooks = [f'--customize-hook=cp {shlex.quote(str(ca))} "$1/etc/ssl/certs/ca-certificates.crt"'] if ca else []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstore-base-") as tmp:
        tarball = Path(tmp) / "base.tar"
        sh("mmdebstrap", *MMDEBSTRAP_OPTIONS, f"--include={','.join(BASE_PACKAGES)}", *hooks, suite, str(tarball),
           mirror, timeout=1200)  # fmt: skip
        sh("docker", "import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "--change", 'CMD ["/bin/bash"]', str(tarball), tag, timeout=600)  # fmt: skip
    docker.figure("base image", f"{tag}, built in {time.monotonic() - started:.0f} s (mmdebstrap + docker import)")
    return tag


def build(tag: str, dockerfile: Path, context: Path, args: dict[str, str], target: str | None = None) -> str:
    """``docker build`` with the host's network; removes the image the tag named before, if replaced.
    Returns how long it took and how many of its RUN steps the layer cache answered."""
    before = image_id(tag)
    build_args = [a for name, value in args.items() for a in ("--build-arg", f"{name}={value}")]
    started = time.monotonic()
    out = sh("docker", "build", "--network", "host", "--pull=false", "-f", str(dockerfile), "-t", tag, *build_args,
             *(["--target", target] if target else []), str(context), timeout=1800)  # fmt: skip
    seconds = time.monotonic() - started
    if before is not None and before != image_id(tag):
        sh("docker", "image", "rm", before, timeout=120, check=False)  # still in use elsewhere: kept
    steps = out.split("\nStep ")[1:]
    runs = [step for step in steps if step.split(" : ", 1)[-1].startswith("RUN ")]
    cached = sum("Using cache" in step for step in runs)
    return f"{seconds:.0f} s ({cached} of {len(runs)} RUN steps cached)" if steps else f"{seconds:.0f} s"


@pytest.fixture(scope="module")
def images(docker: Docker, base_image: str) -> tuple[str, str, str]:
    """The kvstore, etcd and Prometheus images of docker/, built FROM the base (the layer cache makes
    re-runs quick; the Prometheus build checks and unit-tests the alerting rules)."""
    pip = pip_settings()
    args = {"BASE": base_image}
    # The index pip uses here, where it is a URL a build can reach (a file:// index is this disk's).
    if pip.get("index-url", "").startswith(("http://", "https://")):
        args["PIP_INDEX_URL"] = pip["index-url"]
    extra = [url for url in pip.get("extra-index-url", "").split() if url.startswith(("http://", "https://"))]
    if extra:
        args["PIP_EXTRA_INDEX_URL"] = " ".join(extra)
    # The build stage under a tag of its own too, so that the one it replaces goes as well.
    docker.figure("kvstore build stage", build(BUILD_STAGE, REPO / "docker" / "Dockerfile", REPO, args, "build"))
    docker.figure("kvstore image build", build(IMAGE, REPO / "docker" / "Dockerfile", REPO, args))
    docker.figure("etcd image build", build(ETCD_IMAGE, REPO / "docker" / "etcd.Dockerfile", REPO / "docker",
                                            {"BASE": base_image}))  # fmt: skip
    docker.figure("prometheus image build", build(PROMETHEUS_IMAGE, REPO / "docker" / "prometheus.Dockerfile",
                                                  REPO / "docker", {"BASE": base_image}))  # fmt: skip
    for tag in (IMAGE, ETCD_IMAGE, PROMETHEUS_IMAGE):
        size = int(sh("docker", "image", "inspect", "--format", "{{.Size}}", tag, timeout=60).strip())
        docker.figure(f"{tag} size", f"{size / 1e6:.0f} MB")
    return IMAGE, ETCD_IMAGE, PROMETHEUS_IMAGE


def test_image_runs_the_cli_as_a_non_root_user_with_a_healthcheck(images: tuple[str, str, str]) -> None:
    image = images[0]
    config = json.loads(sh("docker", "image", "inspect", "--format", "{{json .Config}}", image, timeout=60))
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["/opt/kvstore/bin/kvstore"]
    assert config["Healthcheck"]["Test"] == ["CMD", "/opt/kvstore/bin/kvstore-healthcheck"]
    assert "/var/lib/kvstore" in config["Volumes"] and "/dev/shm" not in config["Volumes"]
    assert "usage: kvstore" in sh("docker", "run", "--rm", "--network", "none", image, "--help", timeout=120)
    # Without a kvstore process the check fails, saying why.
    out = sh("docker", "run", "--rm", "--network", "none", "--entrypoint", "/opt/kvstore/bin/kvstore-healthcheck",
             image, timeout=120, check=False)  # fmt: skip
    assert "no kvstore process" in out


# -- the compose cluster -----------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """Ports free on loopback, below the kernel's ephemeral range (32768 and up): a port a client's
    connection held there would stay unusable for a listener for up to a minute after it closed."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:  # no SO_REUSEADDR: a TIME_WAIT on the port fails too
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


@dataclass
class Cluster:
    docker: Docker
    project: str
    env: dict[str, str]
    etcd: str
    cluster_id: str
    admin: list[str]

    @property
    def url(self) -> str:
        return f"etcd://{self.etcd}/{self.cluster_id}"

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        return sh(*self.docker.compose, "-p", self.project, "-f", str(COMPOSE_FILE), *args, timeout=timeout,
                  env=self.env, check=check)  # fmt: skip

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service, timeout=60).strip()
        assert cid, f"no container for {service}"
        return cid

    def inspect(self, cid: str, template: str) -> str:
        return sh("docker", "inspect", "--format", template, cid, timeout=60).strip()

    def leader_admin(self) -> str:
        leader = read_leader(EtcdCluster((self.etcd,), self.cluster_id), 5.0)
        assert leader is not None and leader.admin, "no leader in etcd"
        return leader.admin

    def wait_healthy(self, services: tuple[str, ...], timeout: float) -> None:
        ids = [self.container(s) for s in services]
        deadline = time.monotonic() + timeout
        while True:
            states = self.inspect_many(ids, "{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}")
            if all(state == "running/healthy" for state in states):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy within {timeout} s: {dict(zip(services, states, strict=True))}")
            time.sleep(0.5)

    def wait_forgotten(self, keys: set[str], timeout: float) -> None:
        """Until the leader knows none of ``keys`` (a restarted daemon registered without them)."""
        deadline = time.monotonic() + timeout
        for key in sorted(keys):
            while (code := admin_call(self.leader_admin(), "GET", "/api/v1/keys/" + quote(key))[0]) != 404:
                assert time.monotonic() < deadline, f"the master still knows {key} (HTTP {code})"
                time.sleep(0.5)

    def wait_tier(self, keys: set[str], tier: str, timeout: float) -> None:
        """Until every one of ``keys`` has its replica in ``tier``."""
        deadline = time.monotonic() + timeout
        while True:
            where = replicas(self, sorted(keys))
            if all(t == tier for _, t in where.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not all in {tier} within {timeout} s: {where}\n{self.diagnosis()}")
            time.sleep(0.5)

    def diagnosis(self) -> str:
        """What an assertion about the cluster's state should show: the leader's view of the nodes and
        the daemons' and masters' logs (a test's failure does not reach the fixture's own dump)."""
        shown = []
        for path in ("/api/v1/nodes", "/api/v1/cluster"):  # the tiers; the counters of moves and hits
            try:
                code, body = admin_call(self.leader_admin(), "GET", path)
                shown.append(f"{path} ({code}): {json.dumps(body)[:3000]}")
            except (AssertionError, OSError, ValueError) as exc:
                shown.append(f"{path}: {exc!r}")
        logs = self.compose("logs", "--no-color", "--tail=30", "node1", "node2", "master1", "master2",
                            timeout=120, check=False)  # fmt: skip
        return "\n".join([*shown, logs[-8000:]])

    def inspect_many(self, ids: list[str], template: str) -> list[str]:
        return sh("docker", "inspect", "--format", template, *ids, timeout=60).split()

    def wait_nodes_up(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, body = admin_call(self.leader_admin(), "GET", "/api/v1/cluster")
                if status == 200 and body["nodes_up"] == count:
                    return
            except (AssertionError, OSError, ValueError) as exc:
                body = exc
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} nodes not up within {timeout} s: {body}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(docker: Docker, images: tuple[str, str, str]) -> Iterator[Cluster]:
    ports = free_ports(9)
    cluster_id = f"dockertest-{os.getpid()}"
    env = {
        **os.environ,
        "KVSTORE_IMAGE": images[0],
        "KVSTORE_ETCD_IMAGE": images[1],
        "KVSTORE_PROMETHEUS_IMAGE": images[2],
        "KVSTORE_HOST": "127.0.0.1",
        "KVSTORE_CLUSTER_ID": cluster_id,
        # Small tiers: what the test puts is a few MiB, and a CI machine's disk and memory may be short.
        "KVSTORE_DRAM": "64MiB",
        "KVSTORE_SSD": "64MiB",
        "KVSTORE_SHM_SIZE": "96m",
        **{f"KVSTORE_PORT_{name}": str(port) for name, port in zip(
            ("ETCD", "ETCD_PEER", "MASTER1", "ADMIN1", "MASTER2", "ADMIN2", "PROMETHEUS", "NODE1_METRICS",
             "NODE2_METRICS"), ports, strict=True)},
    }  # fmt: skip
    project = f"kvstoretest{os.getpid()}{random.randrange(1 << 20):x}"
    admin = [f"127.0.0.1:{ports[3]}", f"127.0.0.1:{ports[5]}"]
    c = Cluster(docker, project, env, f"127.0.0.1:{ports[0]}", cluster_id, admin)
    try:
        started = time.monotonic()
        c.compose("up", "-d", "--no-build", timeout=300)
        c.wait_healthy(SERVICES, timeout=180)
        docker.figure("compose up -> every container healthy", f"{time.monotonic() - started:.1f} s")
        c.wait_nodes_up(2, timeout=60)
        docker.figure("compose up -> the leader sees both daemons", f"{time.monotonic() - started:.1f} s")
        yield c
    except BaseException:
        print(c.compose("logs", "--no-color", "--tail=40", timeout=120, check=False)[-8000:])
        raise
    finally:
        c.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=300, check=False)
        left = sh("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}", timeout=60)
        assert not left.strip(), f"containers left behind: {left}"


def test_cluster_answers_the_host(cluster: Cluster) -> None:
    out = sh(sys.executable, "-m", "kvstore_cli", "status", "--master", cluster.url, "--json", timeout=120,
             env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    status = json.loads(out[out.index("{") :])
    assert status["nodes_up"] == 2
    masters = {f"127.0.0.1:{cluster.env['KVSTORE_PORT_MASTER1']}", f"127.0.0.1:{cluster.env['KVSTORE_PORT_MASTER2']}"}
    assert {status["ha"]["leader"], *status["ha"]["standbys"]} == masters
    leader = cluster.leader_admin()
    code, page = admin_call(leader, "GET", "/")
    assert code == 200 and "<html" in page.lower()
    for admin in cluster.admin:  # the leader and the standby: each serves /metrics
        code, metrics = admin_call(admin, "GET", "/metrics")
        assert code == 200
        assert f"kvstore_master_leading {1.0 if admin == leader else 0.0}" in metrics
    # Without the engines profile: no workers, no conductor.
    running = sh("docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={cluster.project}", timeout=60)
    assert len(running.split()) == len(SERVICES)


def test_prometheus_scrapes_both_masters_and_both_daemons_with_the_alerting_rules(cluster: Cluster) -> None:
    prometheus = f"http://127.0.0.1:{cluster.env['KVSTORE_PORT_PROMETHEUS']}"
    with urllib.request.urlopen(f"{prometheus}/api/v1/rules", timeout=10) as resp:
        groups = json.loads(resp.read())["data"]["groups"]
    names = {rule["name"] for group in groups for rule in group["rules"]}
    assert {"KvstoreNodeDown", "KvstoreNoLeader", "KvstoreTierDegraded", "KvstoreDaemonCutFromMaster"} <= names
    daemons = [f"127.0.0.1:{cluster.env[f'KVSTORE_PORT_NODE{n}_METRICS']}" for n in (1, 2)]
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(f"{prometheus}/api/v1/targets", timeout=10) as resp:
            targets = json.loads(resp.read())["data"]["activeTargets"]
        healthy = sorted(t["labels"]["instance"] for t in targets if t["health"] == "up")
        if healthy == sorted(cluster.admin + daemons):
            break
        assert time.monotonic() < deadline, f"Prometheus does not scrape both masters and both daemons: {targets}"
        time.sleep(1)
    for address in daemons:  # each daemon's own view: a master answers it (both are up: registered)
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert re.search(r"^kvstore_daemon_registered\{node=\"node[12]\"\} 1\.0$", text, re.M), text


def quote(key: str) -> str:
    return urllib.parse.quote(key, safe="")


def put_blocks(store: Store, keys: list[str], blocks: dict[str, bytes], node: str) -> None:
    statuses = store.put_many([(k, blocks[k]) for k in keys], PutOptions(replicas=1, preferred_node=node))
    assert statuses == [PutStatus.STORED] * len(keys)


def replicas(cluster: Cluster, keys: list[str]) -> dict[str, tuple[str, str]]:
    """The node and tier of each key's one replica, from the leader's admin API."""
    admin, where = cluster.leader_admin(), {}
    for key in keys:
        code, body = admin_call(admin, "GET", "/api/v1/keys/" + quote(key))
        assert code == 200, body
        (replica,) = body["replicas"]
        where[key] = (replica["node_id"], replica["tier"])
    return where


def reads(store: Store, blocks: dict[str, bytes], lost: set[str]) -> None:
    """Keys of ``lost`` read as misses, every other key as its bytes; nothing reads as other bytes."""
    keys = list(blocks)
    got = dict(zip(keys, store.get_many(keys), strict=True))
    wrong = [k for k in keys if got[k] is not None and got[k] != blocks[k]]
    assert not wrong, f"other bytes read for {wrong}"
    assert [k for k in keys if k in lost and got[k] is not None] == [], "blocks that should be gone read as hits"
    assert [k for k in keys if k not in lost and got[k] is None] == [], "blocks that should be there missed"


class Load:
    """Puts and gets from a thread of its own while daemons are killed: every value is derived from
    its key, so any read can be checked. Typed failures (a daemon down, a put that must be retried)
    are allowed; wrong bytes and any other exception are not."""

    def __init__(self, url: str) -> None:
        self.store = Store.connect(url)
        self.stop = threading.Event()
        self.ops = self.failed = 0
        self.wrong: list[str] = []
        self.crashed: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="docker-load", daemon=True)

    @staticmethod
    def value(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest() * 2048  # 64 KiB

    def _run(self) -> None:
        done: list[str] = []
        n = 0
        try:
            while not self.stop.is_set():
                key = f"load/{n}"
                n += 1
                try:
                    self.store.put(key, self.value(key))
                    done.append(key)
                    if len(done) > 32:  # a bounded working set: the test's own blocks are not evicted for it
                        self.store.remove(done.pop(0))
                    for other in random.sample(done, min(4, len(done))):
                        got = self.store.get(other)
                        if got is not None and got != self.value(other):
                            self.wrong.append(other)
                except KVStoreError:
                    self.failed += 1
                self.ops += 1
        except BaseException as exc:  # anything but a typed error fails the test
            self.crashed.append(exc)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)
        self.store.close()
        assert not self.thread.is_alive(), "the load thread hung"


def test_killed_daemon_misses_then_hits(cluster: Cluster) -> None:
    """node1 holds blocks in its SSD tier (a volume) and its DRAM, node2 in its DRAM only. node1 is
    killed with ``docker kill`` and started again, node2 crashes and its restart policy restarts it.
    While a daemon is down its blocks miss; back, its DRAM blocks miss, its SSD blocks hit, the
    other daemon's blocks hit throughout, and a block put again hits. No read returns other bytes."""
    rng = np.random.default_rng(7)
    blocks = {f"dockertest/{i}": rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for i in range(NUM_BLOCKS)}
    keys = list(blocks)
    early, late = keys[: NUM_BLOCKS * 3 // 4], keys[NUM_BLOCKS * 3 // 4 :]
    home = {key: ("node1", "node2")[i % 2] for i, key in enumerate(early)} | dict.fromkeys(late, "node1")
    with Store.connect(cluster.url) as store:
        for node in ("node1", "node2"):
            put_blocks(store, [k for k in early if home[k] == node], blocks, node)
        reads(store, {k: blocks[k] for k in early}, set())
        # node1's blocks so far move to its SSD tier; the late ones then stay in its DRAM.
        code, body = admin_call(cluster.leader_admin(), "POST", "/api/v1/evict", {"node_id": "node1", "tier": "dram"})
        assert code == 200 and body["evicted"] >= len(early) // 2, (code, body, cluster.diagnosis())
        cluster.wait_tier({k for k in early if home[k] == "node1"}, "ssd", timeout=60)
        put_blocks(store, late, blocks, "node1")
        load = Load(cluster.url)
        with load:
            kill_and_restart(cluster, store, blocks, keys)
        cluster.docker.figure("load across the kills", f"{load.ops} put+get rounds, {load.failed} typed failures")
        assert load.ops > 0 and not load.crashed and not load.wrong, (load.crashed, load.wrong)
        assert store.put("dockertest/after", b"after") is not None and store.get("dockertest/after") == b"after"


def kill_and_restart(cluster: Cluster, store: Store, blocks: dict[str, bytes], keys: list[str]) -> None:
    """Kill node1 with ``docker kill`` and start it again, then crash node2 for its restart policy."""
    for victim, how in (("node1", "docker kill"), ("node2", "crash")):
        where = replicas(cluster, keys)
        lost = {k for k, (node, tier) in where.items() if node == victim and tier == "dram"}
        kept = {k for k, (node, tier) in where.items() if node == victim and tier == "ssd"}
        assert lost and len(lost | kept) < len(keys), f"where the blocks are: {sorted(where.values())}"
        cid = cluster.container(victim)
        restarts = int(cluster.inspect(cid, "{{.RestartCount}}"))
        started = time.monotonic()
        if how == "docker kill":  # an operator's stop, which the restart policy leaves alone
            assert kept, f"no block of {victim} on SSD: {sorted(where.values())}"
            sh("docker", "kill", cid, timeout=60)
            reads(store, blocks, lost | kept)  # while it is down
            sh("docker", "start", cid, timeout=120)
        else:  # SIGKILL from outside Docker: `restart: unless-stopped` brings it back by itself
            os.kill(int(cluster.inspect(cid, "{{.State.Pid}}")), signal.SIGKILL)
            deadline = time.monotonic() + 120
            while int(cluster.inspect(cid, "{{.RestartCount}}")) == restarts:
                assert time.monotonic() < deadline, "the restart policy did not restart the crashed daemon"
                time.sleep(0.5)
        cluster.wait_healthy((victim,), timeout=120)
        cluster.wait_forgotten(lost, timeout=60)
        cluster.docker.figure(
            f"{how} {victim} -> back and registered",
            f"{time.monotonic() - started:.1f} s ({len(lost)} DRAM blocks lost, {len(kept)} SSD blocks kept)",
        )
        reads(store, blocks, lost)  # back: its DRAM blocks miss, its SSD blocks hit
        put_blocks(store, sorted(lost), blocks, victim)
        reads(store, blocks, set())  # put again: hits

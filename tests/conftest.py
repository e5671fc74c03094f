"""Shared test helpers: plain factories, no deep fixture chains."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvstore.config import NodeConfig
from kvstore.tiers.dram import DramArena
from kvstore_cli.cluster import LocalEtcd

settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("KVSTORE_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "ci", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile("ci" if os.environ.get("CI") else "default")

_names = itertools.count()
_created: list[NodeConfig] = []


def node_config(tmp_path: Path, dram: Any = "4MiB", ssd: Any = 0, **kwargs: Any) -> NodeConfig:
    """A NodeConfig with a fresh arena name (removed after the test) and an SSD dir under ``tmp_path``."""
    dram_kw = {"capacity": dram} if not isinstance(dram, dict) else dram
    ssd_kw = {"capacity": ssd} if not isinstance(ssd, dict) else ssd
    dram_kw = {"name": f"test-{os.getpid()}-{next(_names)}", **dram_kw}
    if ssd_kw.get("capacity"):
        ssd_kw = {"path": tmp_path / f"ssd-{dram_kw['name']}", **ssd_kw}
    config = NodeConfig(dram=dram_kw, ssd=ssd_kw, **kwargs)
    _created.append(config)
    return config


@pytest.fixture(autouse=True)
def _remove_arenas() -> Iterator[None]:
    yield
    while _created:
        DramArena.remove(_created.pop().dram)


def admin_call(address: str, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """One request to the admin API at ``address``: (HTTP status, the JSON answer, or its text when not JSON)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://{address}{path}", data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
            kind = resp.headers.get("Content-Type", "")
            return resp.status, json.loads(raw) if "json" in kind else raw.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    """A one-member etcd on loopback for HA tests (they skip where etcd is not installed)."""
    server = LocalEtcd().start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Any]:
    """``small_fs(size)``: a directory on a tmpfs of ``size`` (e.g. "64m") of its own, a filesystem
    that fills for real (a full /dev/shm, a small SSD disk); unmounted after. Skips without root."""
    import subprocess

    mounts: list[Path] = []

    def make(size: str) -> Path:
        where = tmp_path / f"fs{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(where)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (root is needed): {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


FACES = ["Store", "AsyncStore"]
"""The two faces of the client, for tests that check both behave alike."""


class BlockingAsyncStore:
    """An AsyncStore called from a test's thread as a Store is: each call runs to its end on the
    store's own event loop. So one test body checks both faces of the client, method by method."""

    def __init__(self, master: str, config: Any = None) -> None:
        from kvstore_client.aio import AsyncStore

        self._loop = asyncio.new_event_loop()
        try:
            self.store = self._loop.run_until_complete(AsyncStore.connect(master, config))
        except BaseException:
            self._loop.close()
            raise

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *args, **kwargs: self._loop.run_until_complete(attr(*args, **kwargs))
        return attr

    def close(self) -> None:
        self._loop.run_until_complete(self.store.close())
        self._loop.close()

    def __enter__(self) -> BlockingAsyncStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_client(face: str, master: str, config: Any = None) -> Any:
    """A client of ``face`` ("Store" or "AsyncStore"), connected to ``master``, used as a Store is."""
    from kvstore_client.store import Store

    return Store.connect(master, config) if face == "Store" else BlockingAsyncStore(master, config)


def run_marked_tests_in(python: str, marker: str, test_file: str, timeout: float) -> None:
    """Run ``test_file``'s ``marker`` tests with another environment's interpreter (an engine's,
    whose pins stay out of the main one), from this checkout; they must all run and pass."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [python, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", test_file]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    last = done.stdout.splitlines()[-1]
    assert " passed" in last and "skipped" not in last, last

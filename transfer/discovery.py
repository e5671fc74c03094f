"""Where the master is: a fixed ``host:port``, or the leader named in etcd.

``etcd://host:2379[,host2:2379]/cluster-id`` names a cluster whose masters elect a leader in
etcd (see :mod:`server.master.election`). The leader holds the key ``/kvstore/<id>/leader``,
bound to its etcd lease, whose value names its RPC and admin addresses; standbys list
themselves under ``/kvstore/<id>/masters/``. Clients and daemons only read: through etcd's
JSON gateway (``POST /v3/kv/range``, and ``POST /v3/watch`` for the leader key), with the
standard library and a timeout per endpoint, so a client needs no gRPC stack.

A :class:`MasterLocator` is what connections to the master hold: its ``address`` is the
master to try now, and :meth:`~MasterLocator.refresh` asks etcd again after a failure or a
``NotLeader`` answer; with a watch, a new leader is pushed to it as etcd elects it. For a
fixed address all of it is trivial.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConnectionFailed, InvalidArgument, NotLeader
from transfer.wire import parse_address

log = logging.getLogger("kvstore.discovery")

SCHEME = "etcd://"
_CLUSTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def validate_cluster_id(cluster_id: str) -> str:
    if not isinstance(cluster_id, str) or not _CLUSTER_ID.match(cluster_id):
        raise InvalidArgument(
            f"cluster id {cluster_id!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return cluster_id


def parse_endpoints(text: str) -> tuple[str, ...]:
    """``"h:2379,h2:2379"`` -> the checked ``host:port`` endpoints."""
    endpoints = tuple(e.strip() for e in text.split(",") if e.strip())
    if not endpoints:
        raise InvalidArgument(f"no etcd endpoint in {text!r}; expected host:port[,host:port...]")
    for endpoint in endpoints:
        parse_address(endpoint)
    return endpoints


@dataclass(frozen=True, slots=True)
class EtcdCluster:
    """A cluster's place in etcd: its endpoints and its id (the key prefix of its masters)."""

    endpoints: tuple[str, ...]
    cluster_id: str

    @classmethod
    def parse(cls, url: str) -> EtcdCluster:
        """``etcd://h:2379[,h2:2379]/cluster-id``; raises InvalidArgument naming what is wrong."""
        if not url.startswith(SCHEME):
            raise InvalidArgument(f"{url!r} is not an etcd:// address")
        rest = url[len(SCHEME) :]
        hosts, sep, cluster_id = rest.partition("/")
        if not sep or not cluster_id:
            raise InvalidArgument(f"{url!r} names no cluster id; expected etcd://host:port[,host:port]/cluster-id")
        return cls(parse_endpoints(hosts), validate_cluster_id(cluster_id.strip("/")))

    @property
    def url(self) -> str:
        return f"{SCHEME}{','.join(self.endpoints)}/{self.cluster_id}"

    @property
    def leader_key(self) -> bytes:
        return f"/kvstore/{self.cluster_id}/leader".encode()

    @property
    def masters_prefix(self) -> bytes:
        return f"/kvstore/{self.cluster_id}/masters/".encode()

    @property
    def nodes_prefix(self) -> bytes:
        return f"/kvstore/{self.cluster_id}/nodes/".encode()

    def node_key(self, node_id: str) -> bytes:
        """Where the leader keeps its record of a node (a member or not, the blocks it must drop
        when it registers again), so that a new leader knows it too."""
        return self.nodes_prefix + node_id.encode()


@dataclass(frozen=True, slots=True)
class MasterRecord:
    """What a master publishes of itself in etcd."""

    address: str
    admin: str | None
    epoch: int = 0
    """The revision at which the key was created: a new leader always has a larger one."""

    def value(self) -> bytes:
        return json.dumps({"address": self.address, "admin": self.admin}).encode()

    @classmethod
    def from_kv(cls, value: bytes, create_revision: int) -> MasterRecord | None:
        try:
            fields = json.loads(value)
            return cls(str(fields["address"]), fields.get("admin"), create_revision)
        except (ValueError, KeyError, TypeError):
            return None  # not one of ours: ignored


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def etcd_range(cluster: EtcdCluster, key: bytes, timeout: float, prefix: bool = False) -> list[dict[str, Any]]:
    """The key-values at ``key`` (or under it, with ``prefix``) as etcd's gateway gives them,
    asking each endpoint in turn; raises ConnectionFailed naming every endpoint when none answers."""
    return etcd_range_at(cluster, key, timeout, prefix)[1]


def etcd_range_at(
    cluster: EtcdCluster, key: bytes, timeout: float, prefix: bool = False
) -> tuple[int, list[dict[str, Any]]]:
    """:func:`etcd_range` with the revision etcd answered at (what a watch goes on from)."""
    body: dict[str, str] = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(_prefix_end(key))
    data = json.dumps(body).encode()
    failures = []
    for endpoint in cluster.endpoints:
        request = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=data, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
            revision = int(answer["header"]["revision"])
        except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError) as exc:
            failures.append(f"{endpoint}: {getattr(exc, 'reason', None) or exc}")
            continue
        out = []
        for kv in answer.get("kvs", []):
            out.append(
                {
                    "key": base64.b64decode(kv["key"]),
                    "value": base64.b64decode(kv.get("value", "")),
                    "create_revision": int(kv.get("create_revision", 0)),
                }
            )
        return revision, out
    raise ConnectionFailed(f"etcd is unreachable at {', '.join(cluster.endpoints)} ({'; '.join(failures)})")


def read_leader(cluster: EtcdCluster, timeout: float) -> MasterRecord | None:
    """The leader etcd names now, or None when there is none (an election under way)."""
    return read_leader_at(cluster, timeout)[1]


def read_leader_at(cluster: EtcdCluster, timeout: float) -> tuple[int, MasterRecord | None]:
    """:func:`read_leader` with the revision etcd answered at."""
    revision, kvs = etcd_range_at(cluster, cluster.leader_key, timeout)
    for kv in kvs:
        return revision, MasterRecord.from_kv(kv["value"], kv["create_revision"])
    return revision, None


def read_masters(cluster: EtcdCluster, timeout: float) -> list[MasterRecord]:
    """Every master that lists itself (leader and standbys), in key order."""
    kvs = etcd_range(cluster, cluster.masters_prefix, timeout, prefix=True)
    return [r for kv in kvs if (r := MasterRecord.from_kv(kv["value"], kv["create_revision"])) is not None]


WATCH_IDLE_S = 30.0
"""A watch of the leader key quiet this long is opened again (what it missed read first); TCP
keep-alives find an etcd gone without a word sooner (:data:`_KEEPALIVE`)."""

_KEEPALIVE = (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3))

_WATCHING: weakref.WeakSet[MasterLocator] = weakref.WeakSet()
"""Locators with a watch: a forked child starts its own (threads do not survive a fork)."""


class MasterLocator:
    """The master a client or daemon talks to: fixed, or the etcd leader (resolved when first
    needed, and again by :meth:`refresh`).

    With ``watch``, an etcd locator also holds a watch of the leader key (etcd's gateway, ``POST
    /v3/watch``, one thread, started on first use): a new leader is known the moment etcd elects
    it, not when a caller next asks, so that a call waiting on a frozen leader moves at once
    (:meth:`current`, :meth:`wait_moved`) and a daemon registers with it at once (:meth:`on_change`).
    What the watch says and what :meth:`refresh` reads are ordered by etcd's revision: the newer
    one stands, so a watch that fell behind never undoes a read (and a revision that went back,
    an etcd restored from a snapshot, is believed as a read). Callers still ask etcd now and then
    while they wait: a watch gone quiet costs that, never a wrong leader. Close a watching
    locator (:meth:`close`): its thread runs until then.
    """

    def __init__(self, master: str, timeout: float = 5.0, *, watch: bool = False) -> None:
        self.spec = master
        self.timeout = timeout
        self.cluster: EtcdCluster | None = None
        self._address: str | None = None
        self._refreshed = 0.0
        self._revision = 0
        """The etcd revision of the newest leader seen (by a read or the watch)."""
        self._leader: str | None = None
        """The leader etcd named at ``_revision`` (None: none, an election under way)."""
        self._listeners: list[Callable[[], None]] = []
        self.asked = 0
        """Reads of etcd :meth:`refresh` made (the watch's own aside)."""
        self._watch = watch
        self._closed = threading.Event()
        self._new_locks()
        if master.startswith(SCHEME):
            self.cluster = EtcdCluster.parse(master)
            if watch:
                _WATCHING.add(self)
        else:
            parse_address(master)
            self._address = master

    def _new_locks(self) -> None:
        self._lock = threading.Lock()
        """Guards the leader seen (held for no I/O: the watch's thread takes it too)."""
        self._reading = threading.Lock()
        """One read of etcd at a time (callers within ``min_interval`` share it)."""
        self._moved = threading.Condition(self._lock)
        self._watcher: threading.Thread | None = None
        self._stream: http.client.HTTPConnection | None = None

    @property
    def dynamic(self) -> bool:
        return self.cluster is not None

    @property
    def watching(self) -> bool:
        """Whether a new leader is pushed to this locator (an etcd locator with ``watch``)."""
        return self._watch and self.cluster is not None

    @property
    def address(self) -> str:
        """The master to try now; for etcd, resolved on first use (raising as :meth:`refresh`)."""
        address = self._address
        return address if address is not None else self.refresh()

    def current(self) -> str | None:
        """The leader as last seen (pushed by the watch, or read), without asking etcd; None when
        the last word was that none leads (or nothing was seen yet)."""
        return self._leader if self.cluster is not None else self._address

    def refresh(self, min_interval: float = 0.0) -> str:
        """Ask etcd for the leader again (at most once per ``min_interval`` s across callers).
        Raises ConnectionFailed when etcd is unreachable, NotLeader when no master leads now."""
        if self.cluster is None:
            assert self._address is not None
            return self._address
        self._start_watch()
        with self._reading:
            if self._address is not None and time.monotonic() - self._refreshed < min_interval:
                return self._address
            self._refreshed = time.monotonic()
            self.asked += 1
            self._read()
        leader = self._leader
        if leader is None:
            raise NotLeader(f"no master leads cluster {self.cluster.cluster_id!r} in etcd now (an election)")
        return leader

    def wait_moved(self, address: str, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a leader other than ``address`` (pushed by the watch; without
        one, simply the wait); True when there is one."""
        if not self.watching:
            time.sleep(timeout)
            return False
        self._start_watch()
        with self._moved:
            return self._moved.wait_for(lambda: self._leader not in (None, address), timeout)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever a new leader is seen, on the thread that saw it (the watch's,
        or a caller's read): it must be quick and must not call this locator."""
        self._listeners.append(listener)

    def close(self) -> None:
        """Stop the watch (a no-op without one)."""
        self._closed.set()
        stream = self._stream
        sock = stream.sock if stream is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the thread reading it wakes and ends
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=2.0)

    # -- what etcd said ------------------------------------------------------------------------
    def _read(self) -> int:
        """Read the leader from etcd and take it in; returns the revision it answered at."""
        assert self.cluster is not None
        before = self._revision
        revision, leader = read_leader_at(self.cluster, min(self.timeout, 2.0))
        self._saw(revision, leader.address if leader is not None else None, reset=revision < before)
        return revision

    def _saw(self, revision: int, leader: str | None, reset: bool = False) -> None:
        """etcd named ``leader`` at ``revision``: taken in if newer than what was seen (``reset``: a
        read older than what was seen before it was sent, an etcd whose history went back)."""
        with self._lock:
            if reset:
                self._revision = 0
            if revision <= self._revision:
                return
            self._revision = revision
            moved = leader is not None and leader != self._leader
            self._leader = leader
            if leader is not None:
                self._address = leader
            if moved:
                self._moved.notify_all()
        if moved:
            for listener in list(self._listeners):
                listener()

    # -- the watch ---------------------------------------------------------------------------
    def _start_watch(self) -> None:
        if not self.watching or self._watcher is not None or self._closed.is_set():
            return
        with self._lock:
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_forever, name="master-leader-watch", daemon=True)
                self._watcher.start()

    def _forked(self) -> None:
        """In a forked child: the parent's thread is not here, and a lock it held stays held."""
        self._new_locks()

    def _watch_forever(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            try:
                self._watch_once()  # back when it went quiet: read and watch again at once
                backoff = 0.1
                continue
            except Exception as exc:  # etcd away, or an answer not understood: callers read meanwhile
                log.debug("watch of the leader of %s: %s; again in %.1f s", self.spec, exc, backoff)
            self._closed.wait(backoff)
            backoff = min(2 * backoff, 2.0)

    def _watch_once(self) -> None:
        """Read the leader, then follow its changes from there until the stream goes quiet for
        WATCH_IDLE_S (then return); raises when no endpoint takes the watch or the stream breaks."""
        assert self.cluster is not None
        revision = self._read()
        body = json.dumps({"create_request": {"key": _b64(self.cluster.leader_key), "start_revision": revision + 1}})
        failures: list[str] = []
        for endpoint in self.cluster.endpoints:
            host, port = parse_address(endpoint)
            stream = http.client.HTTPConnection(host, port, timeout=min(self.timeout, 2.0))
            self._stream = stream
            try:
                if self._closed.is_set():
                    return
                stream.connect()
                assert stream.sock is not None
                stream.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for name, value in _KEEPALIVE:
                    if hasattr(socket, name):
                        stream.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
                stream.request("POST", "/v3/watch", body=body, headers={"Content-Type": "application/json"})
                response = stream.getresponse()
                if response.status != 200:
                    failures.append(f"{endpoint}: HTTP {response.status}")
                    continue
                stream.sock.settimeout(WATCH_IDLE_S)
                try:
                    self._follow(response)
                except TimeoutError:
                    return  # quiet: nothing changed, or etcd went without a word
                return
            except OSError as exc:
                failures.append(f"{endpoint}: {exc}")
            finally:
                self._stream = None
                stream.close()
        raise ConnectionFailed(f"no etcd endpoint took a watch ({'; '.join(failures)})")

    def _follow(self, response: http.client.HTTPResponse) -> None:
        """Take in each change of the leader key the watch streams (one JSON object a line)."""
        while not self._closed.is_set():
            line = response.readline()
            if not line:
                raise ConnectionFailed("etcd ended the watch of the leader key")
            answer = json.loads(line)
            result = answer.get("result") if isinstance(answer, dict) else None
            if not isinstance(result, dict):
                raise ConnectionFailed(f"etcd's watch of the leader key failed: {line[:200]!r}")
            for event in result.get("events", ()):
                kv = event["kv"]
                if event.get("type") == "DELETE":
                    leader = None
                else:
                    record = MasterRecord.from_kv(base64.b64decode(kv.get("value", "")), int(kv["create_revision"]))
                    leader = record.address if record is not None else None
                self._saw(int(kv["mod_revision"]), leader)
            if result.get("canceled"):
                raise ConnectionFailed(f"etcd canceled the watch of the leader key: {result.get('cancel_reason', '')}")

    def __str__(self) -> str:
        return self.spec if self.cluster is None else f"{self.spec} (leader {self._address or 'unresolved'})"


def _after_fork_in_child() -> None:
    for locator in list(_WATCHING):
        locator._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)

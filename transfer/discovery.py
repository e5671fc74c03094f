"""Where the master is: a fixed ``host:port``, or the leader named in etcd.

``etcd://host:2379[,host2:2379]/cluster-id`` names a cluster whose masters elect a leader in
etcd (see :mod:`server.master.election`). The leader holds the key ``/kvstore/<id>/leader``,
bound to its etcd lease, whose value names its RPC and admin addresses; standbys list
themselves under ``/kvstore/<id>/masters/``. Clients and daemons only read: through etcd's
JSON gateway (``POST /v3/kv/range``), with the standard library and a timeout per endpoint,
so a client needs no gRPC stack.

A :class:`MasterLocator` is what connections to the master hold: its ``address`` is the
master to try now, and :meth:`~MasterLocator.refresh` asks etcd again after a failure or a
``NotLeader`` answer. For a fixed address both are trivial.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConnectionFailed, InvalidArgument, NotLeader
from transfer.wire import parse_address

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
        except (OSError, urllib.error.URLError, ValueError) as exc:
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
        return out
    raise ConnectionFailed(f"etcd is unreachable at {', '.join(cluster.endpoints)} ({'; '.join(failures)})")


def read_leader(cluster: EtcdCluster, timeout: float) -> MasterRecord | None:
    """The leader etcd names now, or None when there is none (an election under way)."""
    for kv in etcd_range(cluster, cluster.leader_key, timeout):
        return MasterRecord.from_kv(kv["value"], kv["create_revision"])
    return None


def read_masters(cluster: EtcdCluster, timeout: float) -> list[MasterRecord]:
    """Every master that lists itself (leader and standbys), in key order."""
    kvs = etcd_range(cluster, cluster.masters_prefix, timeout, prefix=True)
    return [r for kv in kvs if (r := MasterRecord.from_kv(kv["value"], kv["create_revision"])) is not None]


class MasterLocator:
    """The master a client or daemon talks to: fixed, or the etcd leader (resolved when first
    needed, and again by :meth:`refresh`)."""

    def __init__(self, master: str, timeout: float = 5.0) -> None:
        self.spec = master
        self.timeout = timeout
        self.cluster: EtcdCluster | None = None
        self._address: str | None = None
        self._lock = threading.Lock()
        self._refreshed = 0.0
        if master.startswith(SCHEME):
            self.cluster = EtcdCluster.parse(master)
        else:
            parse_address(master)
            self._address = master

    @property
    def dynamic(self) -> bool:
        return self.cluster is not None

    @property
    def address(self) -> str:
        """The master to try now; for etcd, resolved on first use (raising as :meth:`refresh`)."""
        address = self._address
        return address if address is not None else self.refresh()

    def refresh(self, min_interval: float = 0.0) -> str:
        """Ask etcd for the leader again (at most once per ``min_interval`` s across callers).
        Raises ConnectionFailed when etcd is unreachable, NotLeader when no master leads now."""
        if self.cluster is None:
            assert self._address is not None
            return self._address
        with self._lock:
            if self._address is not None and time.monotonic() - self._refreshed < min_interval:
                return self._address
            self._refreshed = time.monotonic()
            leader = read_leader(self.cluster, min(self.timeout, 2.0))
            if leader is None:
                raise NotLeader(f"no master leads cluster {self.cluster.cluster_id!r} in etcd now (an election)")
            self._address = leader.address
            return leader.address

    def __str__(self) -> str:
        return self.spec if self.cluster is None else f"{self.spec} (leader {self._address or 'unresolved'})"

"""Fuzz a live cluster: frames built from the message schema, garbled frames, random bytes and
random admin API requests; afterwards, is everything still up and byte-exact?

``python -m bench.fuzz --json [--inputs N] [--seed S]`` starts a master (admin API with a
token) and two daemons as processes on loopback, stores reference blocks, then sends:

- **schema frames** to the master and to a daemon: every message kind, fields drawn from each
  field's type with edge values (empty, negative, 2**63, oversized strings and lists, other
  types in a field's place, fields missing or extra), framed correctly, one after another on
  a kept connection, each followed by a valid request whose answer shows the server is still
  in step (a connection the server closed is opened again);
- **garbled frames**: valid frames with bytes flipped, cut short, or with a lying length, and
  plain random bytes, each on a connection of its own;
- **admin requests**: every operation of the OpenAPI document with random path parameters,
  queries and bodies, with the token, without it, with a wrong one and one of raw bytes;
- **the native loops** (target ``native``, one input in twenty): :mod:`bench.fuzz_native`'s
  streams through the extension and the pure-Python fallback, which must agree.

With ``--auth`` the cluster authenticates: half the RPC inputs go on connections authenticated as
a tenant (every kind, internal ones included, which it must be refused), half before any
handshake (handshake frames, garbled or not, and every other kind).

Left out on purpose without ``--auth``: ``MasterHello`` to a daemon (an unauthenticated peer
claiming a newer master epoch deposes the real master on that daemon; authentication closes
that), and requests that remove or evict the reference blocks by name.

One JSON line per target (``inputs``, ``closed``: connections the server closed, ``rate``
inputs/s), a baseline line (valid requests/s on a kept connection, same run), and a summary:
``inputs``, ``crashes`` (a process that died), ``unhandled`` (tracebacks in the logs),
``http_5xx``, and ``healthy_after``: every reference block reads back byte-exact (or as a
miss, never other bytes), and a new put and get round-trip.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import socket
import string
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from bench.fuzz_native import fuzz as fuzz_native
from kvstore.auth import Credential, tenant_credential
from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError
from kvstore.protocol import (
    FRAME_HEADER,
    KIND_TO_MESSAGE,
    PROTOCOL_VERSION,
    FetchBlocks,
    MasterHello,
    Message,
    ReadBlocks,
    Stats,
    WriteBlocks,
    WriteGranted,
    WriteSlices,
    encode,
)
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from transfer.auth import authenticate

TOKEN = "fuzz-admin-token"
_ENC = msgspec.msgpack.Encoder()
# Daemon requests whose bytes follow the frame: the daemon waits for them, so they go on a
# connection of their own that is closed right after (the next request would be read as bytes).
_TRAILING = (WriteBlocks, WriteGranted, WriteSlices)
_DAEMON_SKIP = (MasterHello,)
_MASTER_KINDS = list(KIND_TO_MESSAGE)
_DAEMON_KINDS = [k for k, c in KIND_TO_MESSAGE.items() if c not in _DAEMON_SKIP]

_INTS = [0, 1, -1, 2, 63, 64, 4096, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, -(2**63), 2**64 - 1]
_STRS = ["", "a", "fuzz/key", "../../etc/passwd", "é" * 10, "\x00", "x" * 300, "node0?", "127.0.0.1:1", "%s%n"]


class Draw:
    """Random values for a field's type, edge values often, now and then a value of another type."""

    def __init__(self, rng: random.Random, max_list: int) -> None:
        self.rng = rng
        self.max_list = max_list

    def any(self) -> Any:
        r = self.rng.random()
        if r < 0.3:
            return self.rng.choice(_INTS)
        if r < 0.6:
            return self.rng.choice(_STRS)
        if r < 0.7:
            return None
        if r < 0.8:
            return [self.any() for _ in range(self.rng.randrange(3))]
        if r < 0.9:
            return self.rng.random() * 1e6
        return self.rng.randbytes(self.rng.randrange(16))

    def value(self, t: Any) -> Any:
        rng = self.rng
        if rng.random() < 0.05:
            return self.any()  # a value of another type
        info = msgspec.inspect
        if isinstance(t, info.IntType):
            return rng.choice(_INTS) if rng.random() < 0.5 else rng.randrange(-10, 1 << 20)
        if isinstance(t, info.FloatType):
            return rng.choice([0.0, -1.0, 1e308, float("inf"), float("nan"), rng.random() * 100])
        if isinstance(t, info.BoolType):
            return rng.random() < 0.5
        if isinstance(t, info.StrType):
            if rng.random() < 0.4:
                return rng.choice(_STRS)
            return "fuzz-" + "".join(rng.choice(string.printable) for _ in range(rng.randrange(40)))
        if isinstance(t, info.BytesType):
            return rng.randbytes(rng.randrange(64))
        if isinstance(t, info.LiteralType):
            return rng.choice(t.values) if rng.random() < 0.9 else "bogus"
        if isinstance(t, info.NoneType):
            return None
        if isinstance(t, info.UnionType):
            return self.value(rng.choice(t.types))
        if isinstance(t, info.ListType | info.VarTupleType | info.SetType | info.FrozenSetType):
            n = rng.choice([0, 1, 2, 5, rng.randrange(self.max_list + 1)])
            return [self.value(t.item_type) for _ in range(n)]
        if isinstance(t, info.DictType):
            keys = [self.value(t.key_type) for _ in range(rng.randrange(4))]
            return {k if isinstance(k, str | int | float | bool | None) else repr(k): self.value(t.value_type)
                    for k in keys}  # fmt: skip
        if isinstance(t, info.StructType):
            return self.struct(t)
        return self.any()

    def struct(self, t: Any) -> list[Any]:
        """A struct as its wire array (array-like structs), fields sometimes dropped or added."""
        fields = [self.value(f.type) for f in t.fields]
        r = self.rng.random()
        if r < 0.03 and fields:
            fields.pop()
        elif r < 0.06:
            fields.append(self.any())
        return [t.tag, *fields] if t.tag is not None else fields


def _frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


def schema_frame(draw: Draw, kind: int, request_id: int) -> bytes:
    body = draw.struct(msgspec.inspect.type_info(KIND_TO_MESSAGE[kind]))
    version = PROTOCOL_VERSION if draw.rng.random() < 0.97 else draw.rng.choice([0, 3, 99, -1, "4"])
    return _frame(_ENC.encode([version, request_id, body]))


def garble(rng: random.Random, frame: bytes) -> bytes:
    """A valid frame spoilt one way: bytes flipped, cut short, a lying length, or noise."""
    r = rng.random()
    data = bytearray(frame)
    if r < 0.4:
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(len(data))
            data[i] = rng.randrange(256)
        return bytes(data)
    if r < 0.6:
        return bytes(data[: rng.randrange(1, len(data))])
    if r < 0.8:
        lie = rng.choice([0, 1, len(data) * 2, 1 << 20, (1 << 32) - 1])
        return FRAME_HEADER.pack(lie) + bytes(data[FRAME_HEADER.size :])
    return rng.randbytes(rng.randrange(1, 512))


class Target:
    """One server's RPC port: a kept connection for in-step frames, fresh ones for the rest."""

    def __init__(
        self, name: str, address: str, sentinel: Message, credential: Callable[[], Credential] | None = None
    ) -> None:
        """``credential``: each connection authenticates with it first (a cluster that authenticates)."""
        self.name = name
        self.credential = credential
        host, port = address.rsplit(":", 1)
        self.address = (host, int(port))
        self.sentinel = encode(sentinel, 1)
        self.sock: socket.socket | None = None
        self.inputs = 0
        self.closed = 0
        self.seconds = 0.0
        self.down = ""
        """Why the server could not be reached any more (it died: a crash), if it could not."""

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=5)
        except ConnectionRefusedError as exc:
            self.down = str(exc)
            raise
        sock.settimeout(5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.credential is not None:
            try:
                authenticate(sock, self.credential(), self.name)
            except BaseException:
                sock.close()
                raise
        return sock

    def _in_step(self, sock: socket.socket) -> bool:
        """Send the sentinel and read frames until its answer (id 1); False if the server closed."""
        try:
            sock.sendall(self.sentinel)
            while True:
                header = _recv_exact(sock, FRAME_HEADER.size)
                (length,) = FRAME_HEADER.unpack(header)
                payload = _recv_exact(sock, length)
                reply = msgspec.msgpack.decode(payload)
                if isinstance(reply, list) and len(reply) > 1 and reply[1] == 1:
                    return True
        except (OSError, ConnectionError, EOFError):
            return False

    def kept(self, frame: bytes) -> None:
        """A well-framed input on the kept connection, then the sentinel."""
        start = time.perf_counter()
        try:
            if self.sock is None:
                self.sock = self._connect()
            self.sock.sendall(frame)
            ok = self._in_step(self.sock)
        except (OSError, KVStoreError):
            ok = False
        if not ok:
            self.closed += 1
            if self.sock is not None:
                self.sock.close()
            self.sock = None
        self.inputs += 1
        self.seconds += time.perf_counter() - start

    def alone(self, data: bytes) -> None:
        """An input on a connection of its own, closed at once (the server must cope with that too)."""
        start = time.perf_counter()
        try:
            with self._connect() as sock:
                sock.sendall(data)
        except (OSError, KVStoreError):
            self.closed += 1
        self.inputs += 1
        self.seconds += time.perf_counter() - start

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def fuzz_rpc(target: Target, kinds: list[int], n: int, rng: random.Random) -> None:
    draw = Draw(rng, max_list=64)
    for i in range(n):
        if target.down:
            return
        kind = rng.choice(kinds)
        frame = schema_frame(draw, kind, 1000 + i)
        cls = KIND_TO_MESSAGE[kind]
        if rng.random() < 0.1:
            target.alone(garble(rng, frame))
        elif cls in _TRAILING or cls is FetchBlocks:
            # Bytes follow (or the daemon dials out and waits): its own connection, closed at once.
            target.alone(frame + rng.randbytes(rng.randrange(64)))
        else:
            target.kept(frame)


def _http_inputs(rng: random.Random, doc: dict[str, Any]) -> Iterator[tuple[str, str, bytes | None, dict[str, str]]]:
    ops = [(path, method.upper(), op) for path, item in doc["paths"].items() for method, op in item.items()]
    tokens = [f"Bearer {TOKEN}", None, "Bearer wrong", "Bearer \udcff\udcfe", "Basic abc", "Bearer " + "x" * 5000]
    draw = Draw(rng, max_list=8)
    while True:
        path, method, op = rng.choice(ops)
        if rng.random() < 0.1:
            method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        url = path
        for name in [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]:
            # Real node names, but never to drain one: two drained nodes leave no room for the check after.
            value = rng.choice(_STRS + ([] if "drain" in path else ["node0", "node1"]) + ["fuzz-missing"])
            url = url.replace("{" + name + "}", urllib.parse.quote(value, safe=""))
        query = {
            p["name"]: str(rng.choice([*_INTS, *_STRS, "abc", "-5"]))
            for p in op.get("parameters", [])
            if p["in"] == "query" and rng.random() < 0.7
        }
        if rng.random() < 0.1:
            query["unknown"] = "1"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        body: bytes | None = None
        if method in ("POST", "PUT", "PATCH"):
            r = rng.random()
            if r < 0.4:
                body = json.dumps({"key": rng.choice([*_STRS, "fuzz-missing"]), "x": draw.any()}, default=repr).encode()
            elif r < 0.7:
                body = json.dumps(draw.any(), default=repr).encode()
            else:
                body = rng.randbytes(rng.randrange(64))
        headers = {"Content-Type": "application/json"}
        token = rng.choice(tokens)
        if token is not None:
            headers["Authorization"] = token
        yield method, url, body, headers


def fuzz_http(address: str, n: int, rng: random.Random) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/api/v1/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    doc = json.loads(conn.getresponse().read())
    statuses: dict[int, int] = {}
    five: list[str] = []
    start = time.perf_counter()
    inputs = _http_inputs(rng, doc)
    for _ in range(n):
        method, url, body, headers = next(inputs)
        # Raw header bytes that are not ASCII go out as latin-1 (http.client's own encoding).
        headers = {k: v.encode("utf-8", "surrogateescape").decode("latin-1") for k, v in headers.items()}
        try:
            conn.request(method, url, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            status = resp.status
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            status = 0
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500:
            five.append(f"{method} {url} -> {status}")
    seconds = time.perf_counter() - start
    conn.close()
    return {
        "target": "admin", "inputs": n, "rate": round(n / seconds), "statuses": dict(sorted(statuses.items())),
        "http_5xx": len(five), "examples_5xx": five[:5],
    }  # fmt: skip


_AUTH_KINDS = [k for k, c in KIND_TO_MESSAGE.items() if c.__name__.startswith("Auth")]


def fuzz_unauthenticated(target: Target, kinds: list[int], n: int, rng: random.Random) -> None:
    """Inputs before any handshake (a cluster that authenticates): handshake frames, garbled or not,
    and every other kind; each on a connection of its own (the server closes on a refusal)."""
    draw = Draw(rng, max_list=64)
    for i in range(n):
        if target.down:
            return
        kind = rng.choice(_AUTH_KINDS if rng.random() < 0.5 else kinds)
        frame = schema_frame(draw, kind, 1000 + i)
        target.alone(garble(rng, frame) if rng.random() < 0.2 else frame)


def baseline(address: str, seconds: float = 1.0, credential: Callable[[], Credential] | None = None) -> float:
    """Valid Stats requests per second on one kept connection: what the fuzz loop's rate compares to."""
    target = Target("baseline", address, Stats(), credential)
    sock = target._connect()
    count, start = 0, time.perf_counter()
    with sock:
        while time.perf_counter() - start < seconds:
            assert target._in_step(sock)
            count += 1
    return count / (time.perf_counter() - start)


def check_health(cluster: LocalCluster, reference: dict[str, bytes], config: ClientConfig) -> dict[str, Any]:
    """Every process alive; reference blocks exact or missing (never other bytes); a new put+get works."""
    procs = [("master", cluster.master), *((f"daemon{i}", d) for i, d in enumerate(cluster.daemons))]
    crashed = [name for name, p in procs if p is None or p.poll() is not None]
    result: dict[str, Any] = {"crashed": crashed, "reference_exact": 0, "reference_missing": 0, "wrong": []}
    if crashed:
        return {**result, "healthy": False}
    deadline = time.monotonic() + 30  # nodes a fuzz frame registered go down after their TTL
    with Store.connect(cluster.master_address, config) as store:
        keys = list(reference)
        got = store.get_many(keys, verify=True)
        for key, value in zip(keys, got, strict=True):
            if value is None:
                result["reference_missing"] += 1
            elif value == reference[key]:
                result["reference_exact"] += 1
            else:
                result["wrong"].append(key)
        fresh = random.randbytes(100_000)
        while True:
            try:
                store.put("fuzz-after", fresh)
                ok = store.get("fuzz-after", verify=True) == fresh
                break
            except KVStoreError as exc:
                if time.monotonic() > deadline:
                    result["after_error"] = f"{type(exc).__name__}: {exc}"
                    ok = False
                    break
                time.sleep(0.5)
    return {**result, "healthy": ok and not result["wrong"]}


def _unhandled(cluster: LocalCluster) -> list[str]:
    """Errors logged by the processes (a handler that failed, a tick that raised): each is a bug.
    Each as its log line and the last line of its traceback (the exception)."""
    found = []
    for log in sorted(cluster.workdir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if " ERROR " not in line:
                continue
            end = i + 1
            while end < len(lines) and not lines[end][:4].isdigit():  # the traceback, up to the next record
                end += 1
            trace = lines[i + 1 : end]
            where = next((t.strip() for t in reversed(trace) if t.strip().startswith("File ")), "")
            cause = trace[-1].strip() if trace else ""
            found.append(f"{log.name}: {line.split(' ERROR ', 1)[1][:120]}: {cause[:200]} ({where[:200]})")
    return found


def run(inputs: int, seed: int, emit: Callable[[dict[str, Any]], None], auth: bool = False) -> dict[str, Any]:
    """``auth``: the cluster authenticates; the RPC inputs go half on connections authenticated as a
    tenant (its token to the master, its ticket to the daemon), half before any handshake."""
    rng = random.Random(seed)
    master_args = ("--reservation-ms", "2000", "--node-ttl-ms", "2000")
    env = {"KVSTORE_ADMIN_TOKEN": TOKEN}
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-fuzz-"))
    with LocalCluster(
        2, dram="32MiB", ssd="32MiB", admin=True, env=env, master_args=master_args, workdir=workdir,
        authenticate=auth,
    ) as cluster:  # fmt: skip
        config = cluster.client_config(timeout_s=10)
        reference = {f"ref-{i}": rng.randbytes(1000 + 97 * i) for i in range(64)}
        with Store.connect(cluster.master_address, config) as store:
            store.put_many(list(reference.items()))
        master_cred = daemon_cred = None
        if auth:
            token = cluster.add_tenant("fuzz")
            master_cred = partial(tenant_credential, token)
            with Store.connect(cluster.master_address, ClientConfig(token=token)) as tenant:
                ticket = tenant._ticket()
            daemon_cred = lambda: ticket  # noqa: E731 - one ticket for the whole run
        base = baseline(cluster.master_address, credential=master_cred)
        emit({"bench": "fuzz", "target": "baseline", "what": "valid Stats requests/s, one connection",
              "rate": round(base)})  # fmt: skip
        # 40% each to the master and a daemon, 20% to the admin API.
        rpc_n, http_n = inputs * 4 // 10, inputs - 2 * (inputs * 4 // 10)
        master = Target("master", cluster.master_address, Stats(), master_cred)
        # A daemon's cheapest valid request: reading no blocks.
        daemon = Target("daemon", cluster.daemon_addresses[0], ReadBlocks([], [], [], []), daemon_cred)
        targets = [master, daemon]
        started = time.perf_counter()
        try:
            if auth:
                # Tenants may send anything: a MasterHello of theirs is refused like any internal request.
                fuzz_rpc(master, _MASTER_KINDS, rpc_n // 2, rng)
                fuzz_rpc(daemon, list(KIND_TO_MESSAGE), rpc_n // 2, rng)
                bare = [Target(f"{t.name}-unauthenticated", f"{t.address[0]}:{t.address[1]}", Stats()) for t in targets]
                fuzz_unauthenticated(bare[0], _MASTER_KINDS, rpc_n - rpc_n // 2, rng)
                fuzz_unauthenticated(bare[1], list(KIND_TO_MESSAGE), rpc_n - rpc_n // 2, rng)
                targets += bare
            else:
                fuzz_rpc(master, _MASTER_KINDS, rpc_n, rng)
                fuzz_rpc(daemon, _DAEMON_KINDS, rpc_n, rng)
        finally:
            for t in targets:
                t.close()
        for t in targets:
            emit({"bench": "fuzz", "target": t.name, "inputs": t.inputs, "closed": t.closed,
                  "rate": round(t.inputs / t.seconds) if t.seconds else 0})  # fmt: skip
        admin = fuzz_http(cluster.admin_address, http_n, rng)
        emit({"bench": "fuzz", **admin})
        # The native loops the daemons ran the frames above through, against the fallback: 1 in 20.
        loops = fuzz_native(max(inputs // 20, 1), seed)
        emit({"bench": "fuzz", **loops})
        health = check_health(cluster, reference, config)
        unhandled = _unhandled(cluster)
        summary = {
            "bench": "fuzz", "target": "summary", "auth": auth,
            "inputs": sum(t.inputs for t in targets) + admin["inputs"],
            "seconds": round(time.perf_counter() - started, 1), "crashes": len(health["crashed"]),
            "unhandled": len(unhandled), "unhandled_examples": unhandled[:5], "http_5xx": admin["http_5xx"],
            "healthy_after": health["healthy"], "reference_exact": health["reference_exact"],
            "reference_missing": health["reference_missing"], "reference_wrong": len(health["wrong"]),
            "seed": seed, "native": loops["native"], "native_inputs": loops["inputs"],
            "native_mismatches": loops["mismatches"],
        }  # fmt: skip
        if "after_error" in health:
            summary["after_error"] = health["after_error"]
        for t in targets:
            if t.down:
                summary[f"{t.name}_down"] = t.down
    if summary["crashes"] or summary["unhandled"] or not summary["healthy_after"]:
        summary["logs"] = str(workdir)  # kept for whoever looks into it
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    emit(summary)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs in all (RPC and HTTP)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output there is)")
    parser.add_argument(
        "--auth", action="store_true", help="a cluster that authenticates: as a tenant, and before any handshake"
    )
    args = parser.parse_args()
    run(args.inputs, args.seed, lambda line: print(json.dumps(line), flush=True), auth=args.auth)


if __name__ == "__main__":
    main()

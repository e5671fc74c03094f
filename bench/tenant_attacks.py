"""One tenant against the cluster: issue 38's attacks, each on a fresh cluster, measured.

``python -m bench.tenant_attacks --json`` starts a master and two daemons of 64 MiB that
authenticate, with alice (an 8 MiB quota) and bob (64 MiB), and runs each attack as a tenant
holding one token would, with raw frames where it speaks them. One JSON line per attack, each
with the longest the master's event loop went without turning while it ran (``loop_stall_ms``,
from the master's own probe) beside the same for a calm minute of ordinary puts and gets in the
same run (the ``calm`` line, the baseline), and what the attack got:

- ``concurrent_quota``: 16 connections of alice's each send PutStart of 8 x 1 MiB at one barrier
  on a full pool (bob's 60 MiB, the rest carol's, a tenant without a quota): MiB reserved against
  her 8 MiB (none: a tenant's put evicts only its own blocks), bob's and carol's blocks before and after;
- ``pinned_flood``: alice pins 1-byte blocks on one node in batches as large as the master takes,
  40,000 in all: how many she got, then how long bob's 50-key put to that node and his Stats take;
- ``huge_batch``: a 200,000-key PutStart and a 500,000-key GetReplicas: the answers;
- ``revoked_writes``: PutStart of 7 x 1 MiB, PutRevoke, WriteSlices into each with the unused
  seals: writes taken, then seconds until bob's ten 1 MiB puts to that node succeed;
- ``sessions``: alice opens master sessions until refused: how many, and whether bob still logs in;
- ``stalled_frames``: six of alice's connections each send 48 MiB of a 64 MiB frame and stop: the
  master's RSS growth, the connections cut at once for her bytes in flight (``max_inflight_bytes``),
  and seconds until it let the others go;
- ``own_evictions``: alice's default client holding 6 MiB puts 64 KiB: her own blocks evicted.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.frames import REQUEST_IDS, ask, raw, ticket
from kvstore.auth import Credential, cluster_credential, read_secret_file, tenant_credential
from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError
from kvstore.protocol import (
    FRAME_HEADER,
    GetReplicas,
    Message,
    PutRevoke,
    PutStart,
    PutStartReply,
    Stats,
    StatsReply,
    WriteSlices,
)
from kvstore_cli.cluster import LocalCluster
from kvstore_client import PutOptions, Store
from transfer.rpc import Connection
from transfer.wire import recv_message, send_message

MiB = 1 << 20


def _ask(address: str, message: Message, credential: Credential, payload: bytes = b"") -> Message | KVStoreError:
    """One request on a fresh connection: the reply, or the error it carried (returned, not raised)."""
    try:
        return ask(address, message, credential, payload)
    except KVStoreError as exc:
        return exc


class Bench:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.master = cluster.master_address
        assert cluster.secret_file is not None
        self.admin = Connection(self.master, 10.0, cluster_credential(read_secret_file(cluster.secret_file)))
        self.alice = cluster.add_tenant("alice", quota=8 * MiB)
        self.bob = cluster.add_tenant("bob", quota=64 * MiB)

    def stall_ms(self) -> float:
        return float(self.admin.call(Stats(), StatsReply).stats["loop_stall_max_ms"])

    def store(self, token: str, **config: Any) -> Store:
        return Store.connect(self.master, ClientConfig(token=token, transport="tcp", **config))

    # -- the attacks -------------------------------------------------------------------------------
    def calm(self) -> dict[str, Any]:
        with self.store(self.bob) as bob:
            began = time.monotonic()
            n = 0
            while time.monotonic() - began < 10:
                bob.put(f"calm-{n % 32}", bytes(64 << 10))
                bob.get(f"calm-{n % 32}")
                n += 1
        return {"ops": 2 * n}

    def concurrent_quota(self) -> dict[str, Any]:
        carol = self.cluster.add_tenant("carol")  # no quota: she fills what bob leaves, so the pool is full
        with self.store(self.bob, grant_bytes=0) as bob, self.store(carol, grant_bytes=0) as filler:
            held = [f"resident-{i}" for i in range(60)]
            for key in held:
                bob.put(key, bytes(MiB))
            carols = [f"filler-{i}" for i in range(80)]
            for key in carols:
                filler.put(key, bytes(MiB))
            before, carol_before = sum(bob.exists_many(held)), sum(filler.exists_many(carols))
        credential, barrier = tenant_credential(self.alice), threading.Barrier(16)
        reserved: list[int] = []

        def attack(n: int) -> None:
            sock, _ = raw(self.master, credential)
            with sock:
                barrier.wait(30)
                send_message(sock, PutStart([f"crowd-{n}-{i}" for i in range(8)], [MiB] * 8, 1, None, False),
                             next(REQUEST_IDS))  # fmt: skip
                reply = recv_message(sock)[1]
            if isinstance(reply, PutStartReply):
                reserved.append(sum(MiB for t in reply.tickets() if t.status == "ok"))

        _run_all([lambda n=n: attack(n) for n in range(16)])  # type: ignore[misc]
        with self.store(self.bob) as bob, self.store(carol) as filler:
            after = sum(bob.exists_many(held))
            carol_after = sum(filler.exists_many(carols))
        return {"quota_mib": 8, "reserved_mib": sum(reserved) / MiB, "bob_blocks_before": before,
                "bob_blocks_after": after, "carol_blocks_before": carol_before,
                "carol_blocks_after": carol_after}  # fmt: skip

    def pinned_flood(self) -> dict[str, Any]:
        credential, got = tenant_credential(self.alice), 0
        began = time.monotonic()
        for batch in range(10):
            keys = [f"pin-{batch}-{i}" for i in range(4096)]
            reply = _ask(self.master, PutStart(keys, [1] * len(keys), 1, "node0", True), credential)
            if isinstance(reply, PutStartReply):
                got += sum(t.status == "ok" for t in reply.tickets())
        flood_s = time.monotonic() - began
        with self.store(self.bob, grant_bytes=0) as bob:
            t = time.monotonic()
            bob.put_many([(f"after-pins-{i}", bytes(4096)) for i in range(50)], PutOptions(preferred_node="node0"))
            put_s = time.monotonic() - t
            t = time.monotonic()
            bob.stats()
            stats_s = time.monotonic() - t
        return {"tried": 40_960, "pinned": got, "flood_s": round(flood_s, 2), "bob_put_50_s": round(put_s, 3),
                "bob_stats_s": round(stats_s, 4)}  # fmt: skip

    def huge_batch(self) -> dict[str, Any]:
        credential = tenant_credential(self.alice)
        many = [f"k{i}" for i in range(200_000)]
        put = _ask(self.master, PutStart(many, [1] * len(many), 1, None, False), credential)
        get = _ask(self.master, GetReplicas([f"k{i}" for i in range(500_000)], [], False), credential)
        return {"put_200k": type(put).__name__, "get_500k": type(get).__name__}

    def revoked_writes(self) -> dict[str, Any]:
        credential = tenant_credential(self.alice)
        keys = [f"half-{i}" for i in range(7)]
        reply = _ask(self.master, PutStart(keys, [MiB] * 7, 1, "node0", False), credential)
        assert isinstance(reply, PutStartReply), reply
        replicas = [t.replicas[0] for t in reply.tickets()]
        _ask(self.master, PutRevoke(keys), credential)
        daemon_ticket, taken = ticket(self.cluster, self.alice), 0
        for key, r in zip(keys, replicas, strict=True):
            answer = _ask(r.address, WriteSlices([key], [r.offset], [MiB], [0], [64 << 10], [r.seal]), daemon_ticket,
                          bytes(64 << 10))  # fmt: skip
            taken += not isinstance(answer, KVStoreError)
        began = time.monotonic()
        with self.store(self.bob, grant_bytes=0) as bob:
            for i in range(10):
                bob.put(f"after-revoke-{i}", bytes(MiB), PutOptions(preferred_node=replicas[0].node_id))
        return {"writes_taken": taken, "bob_puts_s": round(time.monotonic() - began, 3)}

    def sessions(self) -> dict[str, Any]:
        credential, held = tenant_credential(self.alice), []
        refused = ""
        try:
            for _ in range(5000):
                try:
                    held.append(raw(self.master, credential)[0])
                except KVStoreError as exc:
                    refused = str(exc)
                    break
            bob_ok = isinstance(_ask(self.master, Stats(), tenant_credential(self.bob)), StatsReply)
        finally:
            for sock in held:
                sock.close()
        return {"sessions": len(held), "refused": refused, "bob_logs_in": bob_ok}

    def stalled_frames(self) -> dict[str, Any]:
        credential, socks = tenant_credential(self.alice), []
        rss = self.cluster.master.pid if self.cluster.master is not None else 0
        before, cut = _rss_mib(rss), 0
        for _ in range(6):
            sock, _ = raw(self.master, credential)
            try:
                sock.sendall(FRAME_HEADER.pack(64 * MiB) + bytes(48 * MiB))
            except OSError:  # closed mid-frame: it took her past her bytes in flight (256 MiB)
                cut += 1
            socks.append(sock)
        peak = _rss_mib(rss)
        began, closed = time.monotonic(), 0.0
        for sock in socks:
            sock.settimeout(60)
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass
            closed = time.monotonic() - began
            sock.close()
        time.sleep(1)
        return {"master_rss_mib": [before, peak, _rss_mib(rss)], "cut_in_flight": cut,
                "closed_after_s": round(closed, 2)}  # fmt: skip

    def own_evictions(self) -> dict[str, Any]:
        with self.store(self.alice) as alice:
            for i in range(6):
                alice.put(f"own-{i}", bytes(MiB))
            alice.put("small", bytes(64 << 10))
            kept = sum(alice.exists_many([f"own-{i}" for i in range(6)]))
        return {"held_mib": 6, "put_kib": 64, "own_blocks_kept": kept}


def _run_all(jobs: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(line for line in f if line.startswith("VmRSS:"))
        return round(int(rss.split()[1]) / 1024, 1)
    except (OSError, StopIteration):
        return -1.0


ATTACKS = ("calm", "concurrent_quota", "pinned_flood", "huge_batch", "revoked_writes", "sessions", "stalled_frames",
           "own_evictions")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output there is)")
    parser.add_argument("--only", nargs="*", choices=ATTACKS, default=list(ATTACKS))
    args = parser.parse_args(argv)
    for name in args.only:
        with LocalCluster(2, dram="64MiB", authenticate=True) as cluster:
            bench = Bench(cluster)
            began = time.monotonic()
            try:
                line: dict[str, Any] = {"attack": name, **getattr(bench, name)()}
            except KVStoreError as exc:
                line = {"attack": name, "error": f"{type(exc).__name__}: {exc}"}
            line["seconds"] = round(time.monotonic() - began, 2)
            line["loop_stall_ms"] = bench.stall_ms()
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Several rails to one daemon: slices sprayed by measured bandwidth, and failover between rails.

A rail is one data-plane address of a daemon (one per NIC it serves on); the
kernel routes each to the local NIC on its link. A read is cut into slices
of at most ``slice_bytes`` (small blocks share a slice); a pool of at most
``max_inflight`` workers pulls slices from one queue, each worker bound to a
rail, with each rail given workers in proportion to its bandwidth (an EWMA of
what its slices achieved). A faster rail also pulls more slices. Writes go
the same way: small blocks whole, large ones in slices that the daemon
commits together once all have landed (a block is stored whole or not at all).

A slice whose rail fails (refused, reset, or silent past ``timeout``) goes
back to the queue for another rail; a rail that failed ``pause_after`` times
in a row rests for ``cooldown_s`` and is then tried again (a probe: one more
failure rests it again, a success restores it). A transfer fails with a
typed error only when no rail is left to carry it. Every block read over
slices is checked against its checksum, so a block is returned whole and
exact, or as a miss.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.errors import ConnectionFailed, ProtocolError, Timeout
from kvstore.keys import checksum
from kvstore.protocol import CommitBlocks, ReadSlices, WriteBlocks, WriteReply, WriteSlices
from transfer.auth import CredentialSource
from transfer.rpc import ConnectionPool
from transfer.wire import recv_read_reply

# A rail nobody measured yet is assumed to be as fast as this, until its first slice says otherwise.
_UNMEASURED_BPS = 1e9


@dataclass
class Rail:
    address: str
    pool: ConnectionPool
    bandwidth: float = 0.0
    """EWMA of bytes/s over this rail's slices; 0 until measured."""
    failures: int = 0
    """Consecutive failures."""
    paused_until: float = 0.0
    bytes_moved: int = 0


@dataclass
class _Job:
    parts: list[tuple[int, int, int]]
    """(block index, start, length) slices, together at most one slice's bytes."""
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(length for _, _, length in self.parts)


class RailSet:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        timeout: float,
        slice_bytes: int,
        max_inflight: int,
        cooldown_s: float,
        pause_after: int = 2,
        alpha: float = 0.3,
        credential: CredentialSource | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.rails = [Rail(a, ConnectionPool(a, timeout, max_inflight, credential, tls)) for a in addresses]
        self.slice_bytes = slice_bytes
        self.max_inflight = max_inflight
        self.cooldown_s = cooldown_s
        self.pause_after = pause_after
        self.alpha = alpha
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max_inflight + len(self.rails), thread_name_prefix="rail")

    # -- rail state -----------------------------------------------------------------------
    def usable(self) -> list[Rail]:
        """Rails not resting (a rail whose cooldown is over is tried again)."""
        now = time.monotonic()
        return [r for r in self.rails if r.paused_until <= now]

    def _succeeded(self, rail: Rail, nbytes: int, seconds: float) -> None:
        with self._lock:
            rate = nbytes / max(seconds, 1e-6)
            rail.bandwidth = rate if rail.bandwidth == 0 else (1 - self.alpha) * rail.bandwidth + self.alpha * rate
            rail.failures = 0
            rail.paused_until = 0.0
            rail.bytes_moved += nbytes

    def _failed(self, rail: Rail) -> None:
        with self._lock:
            rail.failures += 1
            if rail.failures >= self.pause_after:
                rail.paused_until = time.monotonic() + self.cooldown_s

    def _workers(self, rails: list[Rail], jobs: int) -> list[Rail]:
        """One entry per worker: each rail's share of ``max_inflight`` by bandwidth, at least one each."""
        measured = [r.bandwidth for r in rails if r.bandwidth > 0]
        default = sum(measured) / len(measured) if measured else _UNMEASURED_BPS
        rates = [r.bandwidth or default for r in rails]
        total = sum(rates)
        budget = max(len(rails), min(self.max_inflight, jobs))
        out: list[Rail] = []
        for rail, rate in zip(rails, rates, strict=True):
            out.extend([rail] * max(1, round(budget * rate / total)))
        return out

    # -- transfers ------------------------------------------------------------------------------
    def _run(self, jobs: list[_Job], do: Callable[[Rail, _Job], None], what: str) -> None:
        """Carry every job over the usable rails; raises ConnectionFailed when no rail is left for some."""
        queue = deque(jobs)
        lock = threading.Lock()
        errors: list[BaseException] = []
        failed: set[str] = set()  # rails that failed during this transfer: they carry no more of it

        def worker(rail: Rail) -> None:
            while True:
                with lock:
                    if errors or not queue or rail.address in failed:
                        return
                    job = queue.popleft()
                start = time.perf_counter()
                try:
                    do(rail, job)
                except (ConnectionFailed, Timeout):
                    self._failed(rail)
                    with lock:
                        failed.add(rail.address)
                        queue.appendleft(job)  # for another rail
                    return
                except BaseException as exc:
                    with lock:
                        errors.append(exc)
                    return
                self._succeeded(rail, job.nbytes, time.perf_counter() - start)

        while queue and not errors:
            rails = [r for r in self.usable() if r.address not in failed]
            if not rails:
                raise ConnectionFailed(f"{what}: no rail left of {[r.address for r in self.rails]}")
            futures: list[Future[None]] = [self._executor.submit(worker, r) for r in self._workers(rails, len(queue))]
            for f in futures:
                f.result()
        if errors:
            raise errors[0]

    def _plan(self, sizes: Sequence[int]) -> tuple[list[_Job], list[int]]:
        """Jobs of at most ``slice_bytes``: a large block's slices one a job, small blocks several to
        a job; and the indexes of the sliced blocks."""
        jobs: list[_Job] = []
        sliced: list[int] = []
        group: list[tuple[int, int, int]] = []
        group_bytes = 0
        for i, size in enumerate(sizes):
            if size > self.slice_bytes:
                sliced.append(i)
                jobs.extend(_Job([(i, s, min(self.slice_bytes, size - s))]) for s in range(0, size, self.slice_bytes))
                continue
            if group and group_bytes + size > self.slice_bytes:
                jobs.append(_Job(group))
                group, group_bytes = [], 0
            group.append((i, 0, size))
            group_bytes += size
        if group:
            jobs.append(_Job(group))
        return jobs, sliced

    def read(
        self, keys: Sequence[str], sizes: Sequence[int], checksums: Sequence[int], views: Sequence[memoryview]
    ) -> list[int | None]:
        """Read whole blocks into ``views`` over every rail; per block its size, or None (a miss)."""
        jobs, _ = self._plan(sizes)
        missing: set[int] = set()

        def fetch(rail: Rail, job: _Job) -> None:
            message = ReadSlices([keys[i] for i, _, _ in job.parts], [s for _, s, _ in job.parts],
                                 [n for _, _, n in job.parts])  # fmt: skip
            targets = [views[i][start : start + length] for i, start, length in job.parts]
            with rail.pool.connection() as conn, conn.exchange(message) as (reply, sock):
                got = recv_read_reply(reply, sock, targets, f"ReadSlices from {rail.address}")
            missing.update(i for ok, (i, _, _) in zip(got, job.parts, strict=True) if not ok)

        self._run(jobs, fetch, f"reading {len(keys)} blocks")
        out: list[int | None] = []
        for i, size in enumerate(sizes):
            ok = i not in missing and checksum(views[i][:size]) == checksums[i]
            out.append(size if ok else None)
        return out

    def write(
        self,
        keys: Sequence[str],
        offsets: Sequence[int],
        checksums: Sequence[int],
        views: Sequence[memoryview],
        pinned: bool,
        seals: Sequence[bytes] = (),
        write_ids: Sequence[int] = (),
    ) -> list[tuple[int, str]]:
        """Write blocks into their reserved extents over every rail; per block (error code or 0, message).
        ``seals``: per block, the master's seal of its extent (a tenant's), or none at all; ``write_ids``
        likewise, each block's put's write id.

        Blocks up to ``slice_bytes`` travel whole, several to a WriteBlocks; larger ones in
        slices (WriteSlices, any rail each), then one CommitBlocks makes the daemon check and
        commit them, so a block is stored whole or not at all."""
        jobs, sliced = self._plan([v.nbytes for v in views])
        sliced_set = set(sliced)
        results: dict[int, tuple[int, str]] = {}

        def sealed(idx: Sequence[int]) -> list[bytes]:
            return [seals[i] for i in idx] if seals else []

        def ids(idx: Sequence[int]) -> list[int]:
            return [write_ids[i] for i in idx] if write_ids else []

        lock = threading.Lock()

        def put(rail: Rail, job: _Job) -> None:
            idx = [i for i, _, _ in job.parts]
            message: WriteBlocks | WriteSlices
            if idx[0] not in sliced_set:
                message = WriteBlocks([keys[i] for i in idx], [offsets[i] for i in idx],
                                      [views[i].nbytes for i in idx], [checksums[i] for i in idx], pinned,
                                      sealed(idx), ids(idx))  # fmt: skip
                payload = [views[i] for i in idx]
            else:
                i, start, length = job.parts[0]
                message = WriteSlices([keys[i]], [offsets[i]], [views[i].nbytes], [start], [length], sealed([i]))
                payload = [views[i][start : start + length]]
            with rail.pool.connection() as conn:
                reply = conn.call(message, WriteReply, payload=payload)
            if len(reply.codes) != len(idx):
                raise ProtocolError(f"{rail.address} answered {len(reply.codes)} results for {len(idx)} writes")
            with lock:
                for i, code, text in zip(idx, reply.codes, reply.errors, strict=True):
                    if code or i not in results:  # a block's first failing slice names its failure
                        results[i] = (code, text)

        self._run(jobs, put, f"writing {len(keys)} blocks")
        ready = [i for i in sliced if not results[i][0]]
        if ready:

            def commit(rail: Rail, job: _Job) -> None:
                sizes = [views[i].nbytes for i in ready]
                message = CommitBlocks(
                    [keys[i] for i in ready],
                    [offsets[i] for i in ready],
                    sizes,
                    [checksums[i] for i in ready],
                    pinned,
                    sealed(ready),
                    ids(ready),
                )
                with rail.pool.connection() as conn:
                    reply = conn.call(message, WriteReply)
                if len(reply.codes) != len(ready):
                    raise ProtocolError(f"{rail.address} answered {len(reply.codes)} commits for {len(ready)}")
                for i, code, text in zip(ready, reply.codes, reply.errors, strict=True):
                    results[i] = (code, text)

            self._run([_Job([(ready[0], 0, 0)])], commit, f"committing {len(ready)} sliced blocks")
        return [results[i] for i in range(len(keys))]

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for rail in self.rails:
            rail.pool.close()

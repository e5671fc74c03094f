"""Replay a prefix-block workload through a block store with real bytes.

For each request: find the longest stored prefix of its blocks, load those
(``get_many_into`` a buffer), "compute" the rest (fill them with bytes derived
from their keys) and store them. A block's bytes are a shared random pattern
stamped with its key, so ``verify`` checks every loaded byte.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from kvstore.errors import CorruptBlock, InvalidArgument
from kvstore.keys import block_keys, key_digest
from kvstore.workload import TraceRequest

_STAMP = 16


class ReplayTarget(Protocol):
    """What a replay needs of a store: the batch forms of match, load and save."""

    def match_prefix(self, keys: Sequence[Any]) -> int: ...

    def get_many_into(self, keys: Sequence[Any], buffers: Sequence[Any]) -> list[int | None]: ...

    def put_many(self, items: Iterable[tuple[Any, Any]]) -> Any: ...


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    requests: int
    blocks: int
    hit_blocks: int
    stored_blocks: int
    bytes_loaded: int
    bytes_stored: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = asdict(self)
        seconds = max(self.seconds, 1e-9)
        out.update(
            hit_rate=round(self.hit_rate, 6),
            requests_per_s=round(self.requests / seconds, 1),
            GBps=round((self.bytes_loaded + self.bytes_stored) / seconds / 1e9, 3),
            seconds=round(self.seconds, 3),
        )
        return out


def request_keys(request: TraceRequest, namespace: str = "") -> list[str]:
    """Prefix-chained keys of a request's blocks (its hash ids are the chain's tokens)."""
    return list(block_keys(list(request.hash_ids), 1, namespace))


def replay(
    store: ReplayTarget,
    requests: Iterable[TraceRequest],
    *,
    block_bytes: int = 64 * 1024,
    namespace: str = "replay",
    verify: bool = False,
    seed: int = 0,
    on_request: Callable[[int], None] | None = None,
    realtime: bool = False,
) -> ReplaySummary:
    """Replay ``requests`` in order through ``store``; ``on_request(n_blocks)`` after each one.

    ``realtime`` waits for each request's timestamp (relative to the first); otherwise requests go back to back.
    """
    if block_bytes < _STAMP:
        raise InvalidArgument(f"block_bytes must be at least {_STAMP}, got {block_bytes}")
    pattern = np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8)
    n_req = n_blocks = n_hit = n_stored = 0
    start = time.perf_counter()
    load_buf = np.empty((0, block_bytes), dtype=np.uint8)
    first_ms: int | None = None
    for request in requests:
        if realtime:
            first_ms = request.timestamp_ms if first_ms is None else first_ms
            delay = start + (request.timestamp_ms - first_ms) / 1000 - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        keys = request_keys(request, namespace)
        n_req += 1
        n_blocks += len(keys)
        hit = store.match_prefix(keys)
        if hit:
            if load_buf.shape[0] < hit:
                load_buf = np.empty((max(hit, 2 * load_buf.shape[0]), block_bytes), dtype=np.uint8)
            got = store.get_many_into(keys[:hit], list(load_buf[:hit]))
            # A block evicted between match and load ends the usable prefix there.
            hit = next((i for i, n in enumerate(got) if n != block_bytes), hit)
            if verify:
                _verify(keys[:hit], load_buf[:hit], pattern)
        n_hit += hit
        missing = keys[hit:]
        if missing:
            batch = np.empty((len(missing), block_bytes), dtype=np.uint8)
            batch[:] = pattern
            batch[:, :_STAMP] = _stamps(missing)
            store.put_many(zip(missing, batch, strict=True))
            n_stored += len(missing)
        if on_request is not None:
            on_request(len(keys))
    return ReplaySummary(
        requests=n_req,
        blocks=n_blocks,
        hit_blocks=n_hit,
        stored_blocks=n_stored,
        bytes_loaded=n_hit * block_bytes,
        bytes_stored=n_stored * block_bytes,
        seconds=time.perf_counter() - start,
    )


def _stamps(keys: Sequence[str]) -> np.ndarray:
    return np.frombuffer(b"".join(key_digest(k)[:_STAMP] for k in keys), dtype=np.uint8).reshape(-1, _STAMP)


def _verify(keys: Sequence[str], loaded: np.ndarray, pattern: np.ndarray) -> None:
    stamps = _stamps(keys)
    for i, key in enumerate(keys):
        row = loaded[i]
        if not (np.array_equal(row[:_STAMP], stamps[i]) and np.array_equal(row[_STAMP:], pattern[_STAMP:])):
            raise CorruptBlock(f"replay loaded wrong bytes for block {key!r}")


def replay_concurrently(
    store: ReplayTarget,
    requests: Sequence[TraceRequest],
    engines: int,
    **kwargs: Any,
) -> ReplaySummary:
    """Replay with ``engines`` threads, as that many inference engines sharing one store.

    Requests are routed by their first block, as a cache-aware scheduler would: requests that
    share a prefix go to the same engine, in trace order, so that a follow-up turn never races
    the turn that is still writing its blocks. Counts add up; ``seconds`` is the wall time.
    """
    if engines < 1:
        raise InvalidArgument(f"engines must be at least 1, got {engines}")
    if engines == 1:
        return replay(store, requests, **kwargs)
    shares: list[list[TraceRequest]] = [[] for _ in range(engines)]
    for i, request in enumerate(requests):
        root = request.hash_ids[0] if request.hash_ids else i
        shares[xxhash.xxh64_intdigest(root.to_bytes(8, "little")) % engines].append(request)
    results: list[ReplaySummary | BaseException] = [ValueError("not run")] * engines

    def engine(e: int) -> None:
        try:
            results[e] = replay(store, shares[e], **kwargs)
        except BaseException as exc:  # surfaced below, in the caller's thread
            results[e] = exc

    start = time.perf_counter()
    threads = [threading.Thread(target=engine, args=(e,), name=f"engine-{e}") for e in range(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    parts = [r for r in results if isinstance(r, ReplaySummary)]
    return ReplaySummary(
        requests=sum(p.requests for p in parts),
        blocks=sum(p.blocks for p in parts),
        hit_blocks=sum(p.hit_blocks for p in parts),
        stored_blocks=sum(p.stored_blocks for p in parts),
        bytes_loaded=sum(p.bytes_loaded for p in parts),
        bytes_stored=sum(p.bytes_stored for p in parts),
        seconds=time.perf_counter() - start,
    )

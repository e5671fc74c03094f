"""A discrete-event replay of Mooncake-format traces through the conductor's scheduling core.

N prefill instances, each with a DRAM cache of prefix blocks on its node (LRU,
``cache_tokens`` per node), and M decode instances doing continuous batching.
Every request arrives at its trace time (divided by ``speed``), is scheduled by
:class:`kvstore.scheduling.Scheduler` (the same class the conductor service uses),
waits in its prefill instance's FIFO queue, loads the prefix its node holds (and
fetches the rest of the pool's longest prefix where the scheduler said so),
computes the rest, stores its full blocks on that node, and then decodes.

Costs follow Mooncake's FAST'25 Table 1 (LLaMA3-70B on 8xA800 by default, every
constant a field of :class:`ClusterCost`): prefill FLOPs ``l*(a*n^2*d + b*n*d^2)``
at ``mfu`` of the GPUs' peak, KV of ``2*l*(d/gqa)*s`` bytes per token over
``B_nic`` between nodes and ``B_h2d`` into the GPU, and a decode step that reads
the weights and the batch's KV from HBM at ``mbu`` of its bandwidth, with the KV
room of the HBM left by the weights.

A request's TBT is the mean of its slowest 10% of token intervals (as in the
paper); it meets its SLOs when TTFT <= ``slo.ttft_s`` and TBT <= ``slo.tbt_s``.
``slo_attainment`` is the share of all requests (rejected ones included) that
meet both: the effective request capacity.

Pure: no clock, no threads; the same inputs give the same outputs.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.costs import PrefillCostModel
from kvstore.errors import InvalidArgument
from kvstore.scheduling import (
    POLICIES,
    DecodeLoad,
    DecodeModel,
    Locality,
    Request,
    Scheduler,
    Slo,
    TransferModel,
)
from kvstore.workload import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class ClusterCost:
    """The model and machine a simulated instance runs: FAST'25 Table 1 by default (LLaMA3-70B, 8xA800)."""

    layers: int = 80
    hidden: int = 8192
    gqa: int = 8
    bytes_per_value: int = 2
    attn_coef: float = 4.0
    """``a`` in ``l*(a*n^2*d + b*n*d^2)``."""
    linear_coef: float = 22.0
    """``b`` in ``l*(a*n^2*d + b*n*d^2)``."""
    gpu_flops: float = 8 * 312e12
    mfu: float = 0.5
    """Share of peak FLOPs a prefill reaches."""
    h2d_bytes_per_s: float = 128e9
    nic_bytes_per_s: float = 100e9
    """800 Gbps."""
    hbm_bytes_per_s: float = 8 * 2.039e12
    mbu: float = 0.7
    """Share of HBM bandwidth a decode step reaches."""
    hbm_bytes: float = 8 * 80e9
    params: float = 70e9

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "gqa", "bytes_per_value", "gpu_flops", "mfu", "h2d_bytes_per_s",
                     "nic_bytes_per_s", "hbm_bytes_per_s", "mbu", "hbm_bytes", "params"):  # fmt: skip
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"cluster cost {name} must be positive and finite, got {value}")
        if (
            not (math.isfinite(self.attn_coef) and math.isfinite(self.linear_coef))
            or min(self.attn_coef, self.linear_coef) < 0
        ):
            raise InvalidArgument(f"cost coefficients must be >= 0, got {self.attn_coef} and {self.linear_coef}")
        if self.gqa > self.hidden:
            raise InvalidArgument(f"gqa ({self.gqa}) cannot exceed hidden ({self.hidden})")
        if self.kv_capacity_tokens < 1:
            raise InvalidArgument("the model's weights leave no HBM for KV")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * (self.hidden // self.gqa) * self.bytes_per_value

    def flops(self, n: int) -> float:
        d = self.hidden
        return self.layers * (self.attn_coef * n * n * d + self.linear_coef * n * d * d)

    def prefill_s(self, new: int, past: int) -> float:
        if new <= 0:
            return 0.0
        return (self.flops(past + new) - self.flops(past)) / (self.gpu_flops * self.mfu)

    @property
    def kv_capacity_tokens(self) -> int:
        return int((self.hbm_bytes - self.params * self.bytes_per_value) / self.kv_bytes_per_token)

    def decode_model(self) -> DecodeModel:
        rate = self.hbm_bytes_per_s * self.mbu
        return DecodeModel(
            base_s=self.params * self.bytes_per_value / rate,
            per_token_s=self.kv_bytes_per_token / rate,
            capacity_tokens=self.kv_capacity_tokens,
        )

    def transfer_model(self) -> TransferModel:
        return TransferModel(self.kv_bytes_per_token, self.nic_bytes_per_s, self.h2d_bytes_per_s)

    def fitted_prefill_model(self) -> PrefillCostModel:
        """A prefill polynomial fitted on runs of this cost model (a calibration over prompt shapes)."""
        model = PrefillCostModel()
        for new in (256, 1024, 4096, 16384, 65536):
            for past in (0, 4096, 32768):
                model.observe(new, past, self.prefill_s(new, past))
        return model


@dataclass(frozen=True, slots=True)
class SimConfig:
    scheduler: str = "global"
    prefill: int = 16
    decode: int = 16
    cache_tokens: int = 3_000_000
    """DRAM cache per prefill node, in tokens."""
    block_tokens: int = TRACE_BLOCK_TOKENS
    early_rejection: bool = False
    decode_load: DecodeLoad = "predicted"
    slo: Slo = field(default_factory=Slo)
    speed: float = 1.0
    """Arrival times are divided by this (2: the trace replayed twice as fast)."""
    balancing_threshold: float = 1.0
    replicate_tokens: int = 2048
    """Fetched tokens a request may leave as a replica on its prefill node."""
    decode_time_s: float = 10.0
    """Prior for ``t_d``, the uniform decode time of the predicted decode load."""
    seed: int = 0
    cost: ClusterCost = field(default_factory=ClusterCost)

    def __post_init__(self) -> None:
        if self.scheduler not in POLICIES:
            raise InvalidArgument(f"unknown scheduler {self.scheduler!r}; known: {', '.join(POLICIES)}")
        if self.prefill < 1 or self.decode < 1:
            raise InvalidArgument(f"need >= 1 prefill and decode instance, got {self.prefill} and {self.decode}")
        if self.cache_tokens < 0 or self.block_tokens < 1 or not (math.isfinite(self.speed) and self.speed > 0):
            raise InvalidArgument("need cache_tokens >= 0, block_tokens >= 1 and a finite speed > 0")
        if not (math.isfinite(self.balancing_threshold) and self.balancing_threshold >= 1):
            raise InvalidArgument(f"balancing_threshold must be a finite number >= 1, got {self.balancing_threshold}")


class _NodeCache:
    """One node's DRAM: an LRU of block ids (least recent first), shared counts kept in ``holders``."""

    def __init__(self, capacity_blocks: int, holders: dict[int, int]) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.holders = holders

    def leading(self, ids: Sequence[int]) -> int:
        blocks, n = self.blocks, 0
        for b in ids:
            if b not in blocks:
                break
            n += 1
        return n

    def use(self, ids: Iterable[int]) -> None:
        """Touch held blocks, insert the others, evicting the least recently used."""
        if self.capacity == 0:
            return
        blocks, holders = self.blocks, self.holders
        for b in ids:
            if b in blocks:
                blocks.move_to_end(b)
                continue
            blocks[b] = None
            holders[b] = holders.get(b, 0) + 1
            if len(blocks) > self.capacity:
                old, _ = blocks.popitem(last=False)
                left = holders[old] - 1
                if left:
                    holders[old] = left
                else:
                    del holders[old]


@dataclass(slots=True)
class _Req:
    trace: TraceRequest
    arrival: float
    blocks: tuple[int, ...]
    """Its full blocks' ids (the partial last block is never cached)."""
    fetch: bool = False
    replicate_blocks: int = 0
    predicted_ttft: float = 0.0
    prefill_started: float = 0.0
    local_blocks: int = 0
    prefix_blocks: int = 0
    prefix_tokens: int = 0
    ttft: float = -1.0
    tbt: float = -1.0
    outcome: str = "pending"


@dataclass(slots=True)
class _Decoding:
    remaining: float
    kv: int
    segments: list[list[float]] = field(default_factory=list)
    """[step seconds, tokens generated at that step time]."""


class _DecodeSim:
    """Continuous batching: every active request advances one token per step; the step time changes
    only when a request joins or leaves."""

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.active: dict[int, _Decoding] = {}
        self.kv = 0
        self.last = 0.0
        self.version = 0

    def step_s(self) -> float:
        return self.model.step_s(len(self.active), self.kv)

    def advance(self, now: float, step: float) -> None:
        if self.active and now > self.last:
            steps = (now - self.last) / step
            for d in self.active.values():
                d.remaining -= steps
                seg = d.segments
                if seg and seg[-1][0] == step:
                    seg[-1][1] += steps
                else:
                    seg.append([step, steps])
        self.last = now


def _slowest_tenth(segments: list[list[float]]) -> float:
    """Mean of the slowest 10% of token intervals."""
    total = sum(n for _, n in segments)
    if total <= 0:
        return 0.0
    want = max(1.0, math.ceil(total * 0.1 - 1e-9))
    taken = acc = 0.0
    for step, n in sorted(segments, key=lambda s: -s[0]):
        use = min(n, want - taken)
        acc += use * step
        taken += use
        if taken >= want - 1e-9:
            break
    return acc / taken if taken else 0.0


def _pctl(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def simulate(requests: Sequence[TraceRequest], config: SimConfig) -> dict[str, Any]:
    """Replay ``requests`` over the configured cluster; one summary dict (see the module docstring)."""
    cost, bt = config.cost, config.block_tokens
    decode_model, transfer = cost.decode_model(), cost.transfer_model()
    sched = Scheduler(
        prefill_model=cost.fitted_prefill_model(), transfer=transfer, decode_model=decode_model,
        policy=config.scheduler, slo=config.slo, early_rejection=config.early_rejection,
        decode_load=config.decode_load, balancing_threshold=config.balancing_threshold,
        replicate_max_tokens=config.replicate_tokens, decode_time_s=config.decode_time_s, seed=config.seed,
    )  # fmt: skip
    holders: dict[int, int] = {}
    caches = [_NodeCache(config.cache_tokens // bt, holders) for _ in range(config.prefill)]
    names = [f"p{i}" for i in range(config.prefill)]
    index = {n: i for i, n in enumerate(names)}
    for name in names:
        sched.add_prefill(name, node=name)
    decoders = [_DecodeSim(decode_model) for _ in range(config.decode)]
    dindex = {f"d{i}": i for i in range(config.decode)}
    for name in dindex:
        sched.add_decode(name)
    waiting: list[deque[int]] = [deque() for _ in names]
    running: list[int | None] = [None] * config.prefill
    reqs: list[_Req] = []
    events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, a, b)
    seq = 0
    arrive, prefill_end, decode_tick = 0, 1, 2

    def push(t: float, kind: int, a: int, b: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, a, b))
        seq += 1

    t0 = min((r.timestamp_ms for r in requests), default=0)
    for i, tr in enumerate(requests):
        full = min(len(tr.hash_ids), tr.input_length // bt)
        reqs.append(_Req(tr, (tr.timestamp_ms - t0) / 1000.0 / config.speed, tr.hash_ids[:full]))
        push(reqs[-1].arrival, arrive, i)

    def longest(ids: Sequence[int]) -> int:
        n = 0
        for b in ids:
            if b not in holders:
                break
            n += 1
        return n

    def cap(blocks: int, r: _Req) -> int:
        return min(blocks * bt, r.trace.input_length - 1)

    wasted = 0.0
    hit_tokens = prefilled_tokens = 0

    def start_prefill(p: int, rid: int, now: float) -> None:
        nonlocal hit_tokens, prefilled_tokens
        r = reqs[rid]
        running[p] = rid
        r.prefill_started = now
        local = caches[p].leading(r.blocks)
        prefix = max(local, longest(r.blocks)) if r.fetch else local
        caches[p].use(reversed(r.blocks[:local]))  # the head of a chain last: it is evicted last
        n = r.trace.input_length
        tokens, local_tokens = cap(prefix, r), cap(local, r)
        seconds = (
            transfer.remote_s(tokens - local_tokens)
            + transfer.local_s(local_tokens)
            + cost.prefill_s(n - tokens, tokens)
        )
        r.local_blocks, r.prefix_blocks, r.prefix_tokens = local, prefix, tokens
        r.replicate_blocks = min(r.replicate_blocks, prefix - local)
        hit_tokens += tokens
        prefilled_tokens += n
        push(now + seconds, prefill_end, rid, p)

    def decode_join(rid: int, now: float) -> None:
        r = reqs[rid]
        name = sched.prefill_done(rid, now)
        out = r.trace.output_length - 1  # the prefill gave the first token
        if out <= 0:
            sched.forget(rid, now)  # nothing to decode: not a decode time for t_d
            r.tbt, r.outcome = 0.0, "done"
            return
        d = decoders[dindex[name]]
        d.advance(now, d.step_s())
        kv = r.trace.input_length + r.trace.output_length
        d.active[rid] = _Decoding(float(out), kv)
        d.kv += kv
        reschedule(dindex[name], now)

    def reschedule(di: int, now: float) -> None:
        d = decoders[di]
        d.version += 1
        if d.active:
            rem = min(x.remaining for x in d.active.values())
            push(now + max(rem, 0.0) * d.step_s(), decode_tick, di, d.version)

    while events:
        now, _, kind, a, b = heapq.heappop(events)
        if kind == arrive:
            r = reqs[a]
            nodes = {names[i]: cap(n, r) for i, c in enumerate(caches) if (n := c.leading(r.blocks))}
            loc = Locality(cap(longest(r.blocks), r), nodes)
            dec = sched.schedule(Request(a, r.trace.input_length, r.trace.output_length), loc, now)
            if not dec.accepted:
                r.outcome = f"rejected: {dec.reason}"
                continue
            assert dec.prefill is not None
            r.fetch, r.predicted_ttft = dec.fetch_tokens > 0, dec.ttft_s
            r.replicate_blocks = dec.replicate_tokens // bt
            p = index[dec.prefill]
            if running[p] is None:
                start_prefill(p, a, now)
            else:
                waiting[p].append(a)
        elif kind == prefill_end:
            r, p = reqs[a], b
            # The blocks it computed, then those it reused or fetched and keeps, each chain's head last:
            # an LRU then evicts chains from their tails, and what stays is still a prefix.
            caches[p].use(reversed(r.blocks[r.prefix_blocks :]))
            caches[p].use(reversed(r.blocks[: r.local_blocks + r.replicate_blocks]))
            r.ttft = now - r.arrival
            if sched.decode_admits(a):
                decode_join(a, now)
            else:
                sched.forget(a, now)
                r.outcome = "rejected: at decode"
                wasted += now - r.prefill_started
            running[p] = None
            if waiting[p]:
                start_prefill(p, waiting[p].popleft(), now)
        else:
            d = decoders[a]
            if b != d.version:
                continue
            d.advance(now, d.step_s())
            ended = [rid for rid, x in d.active.items() if x.remaining <= 1e-6]
            if not ended:  # the step left less than float resolution at this time: the least remaining ends
                ended = [min(d.active, key=lambda rid: d.active[rid].remaining)]
            for rid in ended:
                x = d.active.pop(rid)
                d.kv -= x.kv
                reqs[rid].tbt, reqs[rid].outcome = _slowest_tenth(x.segments), "done"
                sched.decode_done(rid, now)
            reschedule(a, now)

    done = [r for r in reqs if r.outcome == "done"]
    ttfts = [r.ttft for r in done]
    tbts = [r.tbt for r in done if r.trace.output_length > 1]
    slo = config.slo
    met = sum(1 for r in done if r.ttft <= slo.ttft_s and r.tbt <= slo.tbt_s)
    rejected = [r for r in reqs if r.outcome.startswith("rejected")]
    errors = [abs(r.predicted_ttft - r.ttft) / r.ttft for r in done if r.ttft > 0]
    return {
        "scheduler": config.scheduler,
        "early_rejection": config.early_rejection,
        "decode_load": config.decode_load if config.early_rejection else None,
        "balancing_threshold": config.balancing_threshold,
        "cache_tokens": config.cache_tokens,
        "prefill": config.prefill,
        "decode": config.decode,
        "speed": config.speed,
        "requests": len(reqs),
        "mean_ttft_s": round(statistics.fmean(ttfts), 4) if ttfts else 0.0,
        "p90_ttft_s": round(_pctl(ttfts, 0.9), 4),
        "mean_tbt_s": round(statistics.fmean(tbts), 5) if tbts else 0.0,
        "p90_tbt_s": round(_pctl(tbts, 0.9), 5),
        "slo_attainment": round(met / len(reqs), 4) if reqs else 0.0,
        "hit_rate": round(hit_tokens / prefilled_tokens, 4) if prefilled_tokens else 0.0,
        "rejected": len(rejected),
        "rejected_at_decode": sum(1 for r in rejected if r.outcome == "rejected: at decode"),
        "wasted_prefill_s": round(wasted, 3),
        "median_ttft_prediction_error": round(statistics.median(errors), 4) if errors else 0.0,
    }


def sweep(
    requests: Sequence[TraceRequest], config: SimConfig, schedulers: Sequence[str], speeds: Sequence[float]
) -> list[dict[str, Any]]:
    """:func:`simulate` for every scheduler at every speed; each row carries its ``request_rate``."""
    if not requests:
        raise InvalidArgument("the trace has no requests")
    span = (max(r.timestamp_ms for r in requests) - min(r.timestamp_ms for r in requests)) / 1000.0
    rows = []
    for speed in speeds:
        for name in schedulers:
            row = simulate(requests, replace(config, scheduler=name, speed=speed))
            row["request_rate"] = round(len(requests) / (span / speed), 4) if span > 0 else 0.0
            rows.append(row)
    return rows

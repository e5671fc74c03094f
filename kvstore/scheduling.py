"""The conductor's scheduling core: where a request is prefilled and decoded, or whether it is turned away.

Mooncake's Algorithm 1 (FAST'25), pure and synchronous: no sockets, threads or
clocks. Time is an argument; the caller (the conductor service, or the trace
simulator in :mod:`kvstore.simulator`) reports what really happened through
:meth:`Scheduler.prefill_done`, :meth:`Scheduler.decode_done` and
:meth:`Scheduler.forget`, and the core keeps the queues it predicts with.

For each request and each prefill instance ``p`` (policy ``global``)::

    local    = tokens of the prompt's prefix held on p's node
    best     = tokens of the longest prefix held anywhere in the pool
    fetch    = best > local * balancing_threshold  and fetching is predicted faster
    TTFT(p)  = queue(p)                    # predicted prefill seconds already queued on p
             + transfer(best - local)      # remote blocks, if fetched
             + load(local)                 # local blocks into the engine
             + prefill(prompt - prefix, prefix)

and the request goes to the instance of smallest TTFT. ``local`` does the same
without fetching (each instance sees only its own cache), ``load`` takes the
shortest queue, ``random`` any instance. The decode instance is the one whose
load with the request added is lowest; a decode load is
``max(TBT / TBT_SLO, KV tokens / KV capacity)`` with the step time from a
:class:`DecodeModel`.

Early rejection (Mooncake v3 section 7): at arrival, a request whose predicted
TTFT exceeds the SLO or whose decode load would exceed 1 is rejected before any
prefill is spent on it. With ``decode_load="none"`` only the TTFT is checked at
arrival and the decode side turns requests away when they reach it
(:meth:`Scheduler.decode_admits`, the baseline that wastes their prefill); with
``"current"`` the decode load is the decode instances' load now; with
``"predicted"`` the decode load is taken
at the time the request's prefill is predicted to end, counting the requests
whose prefill ends by then and dropping those whose decode (a uniform ``t_d``,
learned from finished requests) has ended: this avoids the anti-phase
oscillation that rejection on the current decode load causes.

A fetched prefix may be copied to the chosen instance's node (hot blocks gain a
replica where they are used), at most ``replicate_max_tokens`` per request.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kvstore.costs import PrefillCostModel
from kvstore.errors import InvalidArgument, NoNodes

DecodeLoad = Literal["none", "current", "predicted"]


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives: time to first token, and time between tokens."""

    ttft_s: float = 30.0
    tbt_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise InvalidArgument(f"SLOs must be positive, got ttft {self.ttft_s} s and tbt {self.tbt_s} s")


@dataclass(frozen=True, slots=True)
class Request:
    request_id: int
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 0:
            raise InvalidArgument(
                f"request {self.request_id}: a prompt needs >= 1 token and output >= 0, "
                f"got {self.prompt_tokens} and {self.output_tokens}"
            )


class Locality(NamedTuple):
    """Where a request's prefix is stored, in tokens (whole blocks)."""

    longest: int
    """The longest prefix stored anywhere in the pool (its blocks may sit on several nodes)."""
    nodes: Mapping[str, int]
    """Per node, the longest prefix stored on that node; absent nodes hold none."""


NO_LOCALITY = Locality(0, {})
_NONE: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class TransferModel:
    """Seconds to bring stored KV into an engine: from another node, or from the instance's own node."""

    bytes_per_token: int
    remote_bytes_per_s: float
    local_bytes_per_s: float
    latency_s: float = 0.0

    def remote_s(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / self.remote_bytes_per_s if tokens > 0 else 0.0

    def local_s(self, tokens: int) -> float:
        return tokens * self.bytes_per_token / self.local_bytes_per_s if tokens > 0 else 0.0


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """Seconds per decode step of a batch of ``count`` requests holding ``tokens`` of KV, and the KV room."""

    base_s: float
    per_request_s: float = 0.0
    per_token_s: float = 0.0
    capacity_tokens: int | None = None

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_request_s, self.per_token_s) < 0:
            raise InvalidArgument("decode step costs must be >= 0")
        if self.capacity_tokens is not None and self.capacity_tokens < 1:
            raise InvalidArgument(f"a decode KV capacity is None or >= 1 token, got {self.capacity_tokens}")

    def step_s(self, count: int, tokens: int) -> float:
        return self.base_s + self.per_request_s * count + self.per_token_s * tokens


class Decision(NamedTuple):
    """What the scheduler chose for one request, with the predictions it chose by."""

    request_id: int
    accepted: bool
    reason: str
    """Empty when accepted; otherwise why: ``ttft``, ``tbt`` or ``kv`` (the decode's KV room)."""
    prefill: str | None
    decode: str | None
    ttft_s: float
    """Predicted time to first token: queue + transfer + load + prefill."""
    tbt_s: float
    """Predicted time between tokens on the decode instance."""
    queue_s: float
    transfer_s: float
    prefill_s: float
    """Prefill compute and local load."""
    local_tokens: int
    """Prefix tokens the prefill instance holds on its own node."""
    prefix_tokens: int
    """Prefix tokens the prefill is predicted to reuse (local, plus fetched)."""
    fetch_tokens: int
    """Prefix tokens to fetch from other nodes."""
    replicate_tokens: int
    """Fetched tokens to keep as a replica on the prefill instance's node."""
    decode_load: float


@dataclass(slots=True)
class PrefillInstance:
    """One prefill engine: FIFO, one request at a time. ``jobs`` holds the predicted seconds of every
    request sent to it and not yet done, in order; the first is running since ``head_started``."""

    name: str
    node: str | None = None
    """The store node whose DRAM this instance loads from locally."""
    max_tokens: int | None = None
    up: bool = True
    jobs: dict[int, float] = field(default_factory=dict)
    backlog_s: float = 0.0
    head_started: float = 0.0
    head_s: float = 0.0
    """The running request's prediction."""

    def queue_s(self, now: float) -> float:
        """Predicted seconds until this instance can start a new request."""
        if not self.jobs:
            return 0.0
        ran = now - self.head_started  # the head's prediction bounds what counts as done of it
        ran = 0.0 if ran < 0 else self.head_s if ran > self.head_s else ran
        left = self.backlog_s - ran
        return left if left > 0 else 0.0

    def _add(self, request_id: int, seconds: float, now: float) -> None:
        if not self.jobs:
            self.head_started, self.head_s = now, seconds
        self.jobs[request_id] = seconds
        self.backlog_s += seconds

    def _remove(self, request_id: int, now: float) -> None:
        if request_id not in self.jobs:
            return
        was_head = next(iter(self.jobs)) == request_id
        self.backlog_s -= self.jobs.pop(request_id)
        if not self.jobs:
            self.backlog_s = 0.0  # no drift from float sums
        if was_head and self.jobs:
            self.head_started, self.head_s = now, next(iter(self.jobs.values()))


@dataclass(slots=True)
class DecodeInstance:
    """One decode engine. Every request assigned to it and not done is an entry at its (predicted, then
    actual) decode start time, kept sorted in ``starts``/``kv`` so that the load at a future time is two
    bisections and a sum; ``active_*`` count those whose prefill has ended."""

    name: str
    up: bool = True
    starts: list[float] = field(default_factory=list)
    kv: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    active_count: int = 0
    active_tokens: int = 0

    def _insert(self, request_id: int, start: float, tokens: int) -> None:
        i = bisect.bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.kv.insert(i, tokens)
        self.ids.insert(i, request_id)

    def _drop(self, request_id: int, start: float) -> int:
        i = bisect.bisect_left(self.starts, start)
        while self.ids[i] != request_id:
            i += 1
        del self.starts[i], self.ids[i]
        return self.kv.pop(i)

    def load_at(self, t: float, decode_time_s: float) -> tuple[int, int]:
        """(requests, KV tokens) decoding at time ``t``: started by ``t`` and not ended ``decode_time_s`` after."""
        lo = bisect.bisect_right(self.starts, t - decode_time_s)
        hi = bisect.bisect_right(self.starts, t)
        return hi - lo, sum(self.kv[lo:hi])


class _Plan(NamedTuple):
    prefill: str
    queue_s: float
    transfer_s: float
    prefill_s: float
    local: int
    prefix: int


@dataclass(slots=True)
class _Assigned:
    prefill: str
    decode: str
    predicted_prefill_s: float
    decode_start: float
    kv_tokens: int
    decoding: bool = False


Policy = Callable[["Scheduler", Request, Locality, float, frozenset[str]], Decision]


class Scheduler:
    """Chooses prefill and decode instances per request and keeps the queues it predicts with.

    Who changes what: :meth:`schedule` adds an accepted request to its instances' queues;
    :meth:`prefill_done`, :meth:`decode_done` and :meth:`forget` take it out as the caller
    reports. Instances are added with :meth:`add_prefill`/:meth:`add_decode` and marked up or
    down with :meth:`set_up`; a down instance is never chosen.
    """

    def __init__(
        self,
        *,
        prefill_model: PrefillCostModel,
        transfer: TransferModel,
        decode_model: DecodeModel,
        policy: str = "global",
        slo: Slo | None = None,
        early_rejection: bool = False,
        decode_load: DecodeLoad = "predicted",
        balancing_threshold: float = 1.0,
        replicate_max_tokens: int = 0,
        decode_time_s: float = 10.0,
        seed: int = 0,
        colocated: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown scheduling policy {policy!r}; known: {', '.join(POLICIES)}")
        if decode_load not in ("none", "current", "predicted"):
            raise InvalidArgument(f"decode_load must be none, current or predicted, got {decode_load!r}")
        if not balancing_threshold >= 1.0 or replicate_max_tokens < 0 or not decode_time_s > 0:
            raise InvalidArgument(
                "need balancing_threshold >= 1, replicate_max_tokens >= 0 and decode_time_s > 0, got "
                f"{balancing_threshold}, {replicate_max_tokens}, {decode_time_s}"
            )
        self.policy_name = policy
        self._policy = POLICIES[policy]
        self.prefill_model = prefill_model
        self.transfer = transfer
        self.decode_model = decode_model
        self.slo = slo or Slo()
        self.early_rejection = early_rejection
        self.decode_load_mode = decode_load
        self.balancing_threshold = balancing_threshold
        self.replicate_max_tokens = replicate_max_tokens
        self.decode_time_s = decode_time_s
        """``t_d``: the uniform decode time the predicted decode load assumes (a moving average)."""
        self.rng = random.Random(seed)
        self.colocated = colocated
        """Each prefill instance decodes its own requests (an engine serving whole requests): the decode
        instance is the one of the same name, not the least loaded."""
        self.prefill: dict[str, PrefillInstance] = {}
        self.decode: dict[str, DecodeInstance] = {}
        self._assigned: dict[int, _Assigned] = {}
        self._refresh()

    def _refresh(self) -> None:
        """Recompute what decisions read of the instance set (after an instance is added or marked)."""
        self._up_prefill = [p for p in self.prefill.values() if p.up]
        self._up_decode = [d for d in self.decode.values() if d.up]
        limits = [p.max_tokens for p in self.prefill.values()]
        self._max_prompt = None if not limits or None in limits else max(x for x in limits if x is not None)

    # -- instances ---------------------------------------------------------------------------
    def add_prefill(self, name: str, *, node: str | None = None, max_tokens: int | None = None) -> PrefillInstance:
        if name in self.prefill:
            raise InvalidArgument(f"prefill instance {name!r} is already known")
        inst = self.prefill[name] = PrefillInstance(name, node, max_tokens)
        self._refresh()
        return inst

    def add_decode(self, name: str) -> DecodeInstance:
        if name in self.decode:
            raise InvalidArgument(f"decode instance {name!r} is already known")
        inst = self.decode[name] = DecodeInstance(name)
        self._refresh()
        return inst

    def set_up(self, name: str, up: bool) -> None:
        """Mark an instance up or down (both roles of an engine that has both); a down one is never chosen."""
        found: list[PrefillInstance | DecodeInstance] = [r[name] for r in (self.prefill, self.decode) if name in r]
        if not found:
            raise InvalidArgument(f"no instance named {name!r}")
        for inst in found:
            inst.up = up
        self._refresh()

    def max_prompt_tokens(self) -> int | None:
        """The longest prompt some prefill instance takes (None: no limit)."""
        return self._max_prompt

    # -- decisions ---------------------------------------------------------------------------
    def schedule(
        self, request: Request, locality: Locality, now: float, *, exclude: Iterable[str] = (),
        policy: str | None = None,
    ) -> Decision:  # fmt: skip
        """Choose instances for ``request`` arriving at ``now`` (instances in ``exclude`` are skipped;
        ``policy`` overrides the scheduler's own for this request, e.g. ``load`` when locality is unknown).

        An accepted request joins its instances' queues. Raises :class:`InvalidArgument` when the prompt
        is longer than every instance takes, :class:`NoNodes` when no instance of a role is up.
        """
        if request.request_id in self._assigned:
            raise InvalidArgument(f"request {request.request_id} is already scheduled")
        limit = self._max_prompt
        if limit is not None and request.prompt_tokens > limit:
            raise InvalidArgument(
                f"a prompt of {request.prompt_tokens} tokens is longer than any prefill instance takes ({limit})"
            )
        if policy is not None and policy not in POLICIES:
            raise InvalidArgument(f"unknown scheduling policy {policy!r}; known: {', '.join(POLICIES)}")
        choose = self._policy if policy is None else POLICIES[policy]
        decision = choose(self, request, locality, now, frozenset(exclude) if exclude else _NONE)
        if decision.accepted:
            assert decision.prefill is not None and decision.decode is not None
            kv = request.prompt_tokens + request.output_tokens
            start = now + decision.ttft_s
            busy_s = decision.ttft_s - decision.queue_s
            self.prefill[decision.prefill]._add(request.request_id, busy_s, now)
            self.decode[decision.decode]._insert(request.request_id, start, kv)
            self._assigned[request.request_id] = _Assigned(decision.prefill, decision.decode, busy_s, start, kv)
        return decision

    def _candidates(self, request: Request, exclude: frozenset[str]) -> list[PrefillInstance]:
        out = self._up_prefill
        if exclude or self._max_prompt is not None:
            out = [
                p for p in out
                if p.name not in exclude and (p.max_tokens is None or request.prompt_tokens <= p.max_tokens)
            ]  # fmt: skip
        if not out:
            raise NoNodes("no prefill instance is up that takes this prompt")
        return out

    def _costs(self, request: Request, local: int, best: int, *, fetch: bool) -> tuple[int, float, float]:
        """(prefix tokens, transfer seconds, load + prefill seconds) for an instance holding ``local``."""
        model, transfer = self.prefill_model, self.transfer
        prefill_s = transfer.local_s(local) + model.predict(request.prompt_tokens - local, local)
        if fetch and best > local * self.balancing_threshold:
            fetch_s = transfer.remote_s(best - local)
            fetched_s = transfer.local_s(local) + model.predict(request.prompt_tokens - best, best)
            if fetch_s + fetched_s < prefill_s:
                return best, fetch_s, fetched_s
        return local, 0.0, prefill_s

    def _plan(
        self, candidates: Iterable[PrefillInstance], request: Request, locality: Locality, now: float, *,
        fetch: bool, by_queue: bool = False,
    ) -> _Plan:  # fmt: skip
        """The prediction on the candidate of smallest TTFT (or queue, ``by_queue``); decode fields empty."""
        cap = request.prompt_tokens - 1  # the last token is always computed: it gives the first output
        best_len = min(locality.longest, cap)
        nodes = locality.nodes
        memo: dict[int, tuple[int, float, float]] = {}  # instances holding as much cost the same
        chosen: tuple[float, PrefillInstance, int, tuple[int, float, float], float] | None = None
        for p in candidates:
            local = nodes.get(p.node, 0) if p.node is not None else 0
            if local > cap:
                local = cap
            costs = memo.get(local)
            if costs is None:
                costs = memo[local] = self._costs(request, local, best_len, fetch=fetch)
            queue_s = 0.0  # PrefillInstance.queue_s, inlined: this loop runs for every instance
            if p.jobs:
                ran = now - p.head_started
                ran = 0.0 if ran < 0 else p.head_s if ran > p.head_s else ran
                queue_s = p.backlog_s - ran
                if queue_s < 0:
                    queue_s = 0.0
            key = queue_s if by_queue else queue_s + costs[1] + costs[2]
            # On a tie the instance holding more of the prefix: a cost model that cannot tell (a fit flat in
            # tokens, a free local cache) must not send a request away from the cache that holds it. Not
            # by queue alone: load balancing is blind to the cache.
            if chosen is None or key < chosen[0] or (not by_queue and key == chosen[0] and local > chosen[2]):
                chosen = (key, p, local, costs, queue_s)
        assert chosen is not None
        _, p, local, (prefix, transfer_s, prefill_s), queue_s = chosen
        return _Plan(p.name, queue_s, transfer_s, prefill_s, local, prefix)

    def _with_decode(self, plan: _Plan, request: Request, now: float, *, pick_random: bool = False) -> Decision:
        """Add the decode instance and the admission verdict to a prefill plan."""
        up = self._up_decode
        if not up:
            raise NoNodes("no decode instance is up")
        kv = request.prompt_tokens + request.output_tokens
        ttft = plan.queue_s + plan.transfer_s + plan.prefill_s
        at = now + ttft
        if self.colocated:
            d = self.decode.get(plan.prefill)
            if d is None or not d.up:
                raise NoNodes(f"instance {plan.prefill} has no decode side up")
            load, tbt, reason = self._decode_load(d, kv, at)
        elif pick_random:
            d = self.rng.choice(up)
            load, tbt, reason = self._decode_load(d, kv, at)
        else:
            d, load, tbt, reason = self._least_loaded(up, kv, at)
        accepted = True
        if self.early_rejection:
            if ttft > self.slo.ttft_s:
                accepted = False
                reason = "ttft"
            elif load > 1.0 and self.decode_load_mode != "none":
                accepted = False
        fetched = plan.prefix - plan.local
        return Decision(
            request.request_id, accepted, "" if accepted else reason, plan.prefill, d.name, ttft, tbt, plan.queue_s,
            plan.transfer_s, plan.prefill_s, plan.local, plan.prefix, fetched,
            min(fetched, self.replicate_max_tokens), load,
        )  # fmt: skip

    def _least_loaded(self, up: list[DecodeInstance], kv: int, at: float) -> tuple[DecodeInstance, float, float, str]:
        """(instance, load, TBT, what bounds it) of the decode instance of lowest load with the request
        added (:meth:`_decode_load`, unrolled: this loop is a large part of a decision's time)."""
        m = self.decode_model
        base, per_request, per_token = m.base_s, m.per_request_s, m.per_token_s
        inv_slo = 1.0 / self.slo.tbt_s
        inv_cap = 1.0 / m.capacity_tokens if m.capacity_tokens else 0.0
        predicted = self.decode_load_mode == "predicted"
        since = at - self.decode_time_s
        right = bisect.bisect_right
        best, lowest, best_tbt, best_reason = up[0], float("inf"), 0.0, "tbt"
        fixed = base + per_request + per_token * kv  # the request itself
        for inst in up:
            if predicted:
                starts = inst.starts
                lo = right(starts, since)
                hi = right(starts, at, lo)
                count, tokens = hi - lo, sum(inst.kv[lo:hi])
            else:
                count, tokens = inst.active_count, inst.active_tokens
            tbt = fixed + per_request * count + per_token * tokens
            load, reason = tbt * inv_slo, "tbt"
            room = (tokens + kv) * inv_cap
            if room > load:
                load, reason = room, "kv"
            if load < lowest:
                best, lowest, best_tbt, best_reason = inst, load, tbt, reason
        return best, lowest, best_tbt, best_reason

    def _decode_load(self, d: DecodeInstance, kv: int, at: float) -> tuple[float, float, str]:
        """(load, TBT, what bounds it) on ``d`` with a request of ``kv`` tokens added."""
        if self.decode_load_mode == "predicted":
            count, tokens = d.load_at(at, self.decode_time_s)
        else:
            count, tokens = d.active_count, d.active_tokens
        count, tokens = count + 1, tokens + kv
        tbt = self.decode_model.step_s(count, tokens)
        load = tbt / self.slo.tbt_s
        cap = self.decode_model.capacity_tokens
        if cap is not None and tokens > load * cap:
            return tokens / cap, tbt, "kv"
        return load, tbt, "tbt"

    def decode_admits(self, request_id: int) -> bool:
        """Whether the request's decode instance, as loaded now, meets the TBT SLO and KV room with it
        (the decode side's own check when a prefill hands it a request)."""
        a = self._assigned[request_id]
        d = self.decode[a.decode]
        count, tokens = d.active_count + 1, d.active_tokens + a.kv_tokens
        cap = self.decode_model.capacity_tokens
        return self.decode_model.step_s(count, tokens) <= self.slo.tbt_s and (cap is None or tokens <= cap)

    # -- what happened -----------------------------------------------------------------------
    def prefill_done(self, request_id: int, now: float) -> str:
        """The request's prefill ended at ``now``: it leaves its prefill queue and starts decoding
        (counted in the decode's current load). Returns the decode instance's name."""
        a = self._assigned[request_id]
        self.prefill[a.prefill]._remove(request_id, now)
        d = self.decode[a.decode]
        if not a.decoding:
            d._drop(request_id, a.decode_start)
            a.decode_start, a.decoding = now, True
            d._insert(request_id, now, a.kv_tokens)
            d.active_count += 1
            d.active_tokens += a.kv_tokens
        return a.decode

    def move_decode(self, request_id: int, decode: str, now: float) -> None:
        """The request decodes on ``decode`` from ``now`` instead (its first decode instance failed)."""
        a = self._assigned[request_id]
        old = self.decode[a.decode]
        old._drop(request_id, a.decode_start)
        if a.decoding:
            old.active_count -= 1
            old.active_tokens -= a.kv_tokens
        new = self.decode[decode]
        a.decode, a.decode_start, a.decoding = decode, now, True
        new._insert(request_id, now, a.kv_tokens)
        new.active_count += 1
        new.active_tokens += a.kv_tokens

    def decode_done(self, request_id: int, now: float) -> None:
        """The request's decode ended at ``now`` (its duration updates ``t_d``)."""
        a = self._assigned.get(request_id)
        if a is None:
            return
        if a.decoding:
            self.decode_time_s += 0.1 * (max(0.0, now - a.decode_start) - self.decode_time_s)
        self.forget(request_id, now)

    def forget(self, request_id: int, now: float) -> None:
        """Drop the request from every queue (rejected at decode, failed, or cancelled)."""
        a = self._assigned.pop(request_id, None)
        if a is None:
            return
        self.prefill[a.prefill]._remove(request_id, now)
        d = self.decode[a.decode]
        d._drop(request_id, a.decode_start)
        if a.decoding:
            d.active_count -= 1
            d.active_tokens -= a.kv_tokens

    def assigned(self, request_id: int) -> tuple[str, str] | None:
        a = self._assigned.get(request_id)
        return None if a is None else (a.prefill, a.decode)

    @property
    def in_flight(self) -> int:
        return len(self._assigned)


# -- policies: a registry by name ---------------------------------------------------------------


def _global(s: Scheduler, r: Request, loc: Locality, now: float, exclude: frozenset[str]) -> Decision:
    """Algorithm 1 with the global pool: smallest queue + transfer + prefill, fetching where it pays."""
    return s._with_decode(s._plan(s._candidates(r, exclude), r, loc, now, fetch=True), r, now)


def _local(s: Scheduler, r: Request, loc: Locality, now: float, exclude: frozenset[str]) -> Decision:
    """Cache-aware on each instance's own cache only: no fetching."""
    return s._with_decode(s._plan(s._candidates(r, exclude), r, loc, now, fetch=False), r, now)


def _load(s: Scheduler, r: Request, loc: Locality, now: float, exclude: frozenset[str]) -> Decision:
    """Load balancing: the shortest queue, blind to where the cache is."""
    return s._with_decode(s._plan(s._candidates(r, exclude), r, loc, now, fetch=False, by_queue=True), r, now)


def _random(s: Scheduler, r: Request, loc: Locality, now: float, exclude: frozenset[str]) -> Decision:
    p = s.rng.choice(s._candidates(r, exclude))
    return s._with_decode(s._plan([p], r, loc, now, fetch=False), r, now, pick_random=True)


POLICIES: dict[str, Policy] = {"random": _random, "load": _load, "local": _local, "global": _global}

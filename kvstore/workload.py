"""Request workloads in Mooncake's trace format, and the exact-LRU reference.

A request is ``timestamp`` (ms), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``: one id per 512-token prefix block, equal ids meaning
a reusable prefix block. :func:`load_trace` reads such a JSON-lines file;
:func:`chat_workload` generates a multi-turn chat workload in the same form;
:func:`lru_prefix_hit_rate` is the reference a replay is compared against.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_request(obj: object, where: str = "request") -> TraceRequest:
    """Validate one decoded JSON object; raises :class:`InvalidArgument` naming ``where`` and the field."""
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fields = {}
    for name in ("timestamp", "input_length", "output_length"):
        value = obj.get(name, 0 if name == "output_length" else None)
        if type(value) is not int or value < 0:
            raise InvalidArgument(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
        fields[name] = value
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise InvalidArgument(f"{where}: 'hash_ids' must be a list of non-negative integers")
    return TraceRequest(fields["timestamp"], fields["input_length"], fields["output_length"], tuple(ids))


def load_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """Requests of a JSON-lines trace file, in file order; blank lines are skipped."""
    try:
        fh = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise InvalidArgument(f"cannot read trace {path}: {exc.strerror}") from None
    with fh:
        count = 0
        for lineno, line in enumerate(fh, 1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
            yield parse_request(obj, f"{path}:{lineno}")
            count += 1


def chat_workload(
    num_sessions: int = 300,
    max_turns: int = 8,
    num_system_prompts: int = 8,
    system_blocks: int = 4,
    turn_blocks: tuple[int, int] = (1, 4),
    mean_gap_ms: float = 200.0,
    think_ms: float = 5000.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """A multi-turn chat workload: sessions share a few system prompts, and each turn
    resends the whole conversation so far plus the new message.

    Sessions arrive as a Poisson process; turns of a session are ``think_ms``
    apart on average, so sessions interleave. Deterministic for a ``seed``.
    """
    if num_sessions <= 0 or max_turns <= 0 or num_system_prompts <= 0 or system_blocks < 0:
        raise InvalidArgument("chat_workload needs positive session, turn and system-prompt counts")
    rng = random.Random(seed)
    next_id = num_system_prompts * system_blocks
    prompts = [list(range(p * system_blocks, (p + 1) * system_blocks)) for p in range(num_system_prompts)]
    requests: list[TraceRequest] = []
    start = 0.0
    for _ in range(num_sessions):
        start += rng.expovariate(1.0 / mean_gap_ms)
        context = list(rng.choice(prompts))
        when = start
        for _ in range(rng.randint(1, max_turns)):
            grow = rng.randint(*turn_blocks)
            context.extend(range(next_id, next_id + grow))
            next_id += grow
            output = rng.randint(16, 512)
            requests.append(TraceRequest(int(when), len(context) * TRACE_BLOCK_TOKENS, output, tuple(context)))
            when += rng.expovariate(1.0 / think_ms)
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def lru_prefix_hit_rate(requests: Iterable[TraceRequest], capacity_blocks: int) -> float:
    """Fraction of blocks hit by an exact LRU cache of ``capacity_blocks`` blocks.

    Each request hits its leading stored blocks up to the first miss; every
    block of the request is then used (touched or inserted), in order.
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for req in requests:
        prefix = True
        for block in req.hash_ids:
            total += 1
            if prefix and block in cache:
                hits += 1
            else:
                prefix = False
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hits / total if total else 0.0

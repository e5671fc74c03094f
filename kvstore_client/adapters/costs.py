"""Load or recompute: the cost models a prefill worker decides with, and the decision.

Pure and synchronous: they take measurements as arguments and hold no tensors,
sockets or clocks, so every decision can be replayed in a test.

- :class:`~kvstore.costs.PrefillCostModel` (in the core, shared with the
  conductor): seconds to compute ``new`` tokens after ``past`` cached ones,
  fitted on the worker's own recent prefills.
- :class:`LoadCostModel`: seconds to load ``n`` bytes from the store,
  ``latency + n / bandwidth``, fitted on the worker's own recent loads.
- :func:`plan_load`: how many of the stored leading blocks to load so that load
  plus the remaining prefill is shortest.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.costs import PrefillCostModel
from kvstore.errors import InvalidArgument

__all__ = ["LoadCostModel", "LoadPlan", "PrefillCostModel", "plan_load"]


@dataclass(slots=True)
class LoadCostModel:
    """Predicted load seconds from observed loads: ``latency_s + bytes / bandwidth``.

    Starts from a prior (``latency_s``, ``bytes_per_s``) that a probe or the first real
    loads replace; each observation moves both by an exponential moving average.
    """

    latency_s: float = 0.002
    bytes_per_s: float = 1e9
    alpha: float = 0.3
    observed: int = 0

    def observe(self, num_bytes: int, seconds: float, *, calls: int = 1) -> None:
        """One load of ``num_bytes`` that took ``seconds`` over ``calls`` store round trips."""
        if num_bytes <= 0 or seconds <= 0:
            return
        transfer = max(seconds - calls * self.latency_s, seconds * 0.5)
        rate = num_bytes / transfer
        weight = 1.0 if self.observed == 0 else self.alpha
        self.bytes_per_s += weight * (rate - self.bytes_per_s)
        self.observed += 1

    def observe_latency(self, seconds: float) -> None:
        """One store round trip that moved (almost) no bytes."""
        self.latency_s += self.alpha * (seconds - self.latency_s)

    def predict(self, num_bytes: int) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to load, and what the models predicted for it and for recomputing everything."""

    blocks: int
    """Leading stored blocks to load (0: recompute all)."""
    tokens: int
    """Tokens those blocks give the prefill (at most ``prompt - 1``: the last token is always computed)."""
    predicted_s: float
    """Predicted load plus the rest of the prefill."""
    recompute_s: float
    """Predicted prefill of the whole prompt."""
    load_s: float

    @property
    def deadline_s(self) -> float:
        """How long the load may take before recomputing would have been faster."""
        return self.recompute_s - (self.predicted_s - self.load_s)


def plan_load(
    prompt_tokens: int,
    stored_blocks: int,
    block_tokens: int,
    block_bytes: int,
    prefill: PrefillCostModel,
    load: LoadCostModel,
) -> LoadPlan:
    """The number of leading stored blocks whose load makes the prefill shortest (ties go to loading more)."""
    if prompt_tokens <= 0:
        raise InvalidArgument(f"a prompt has at least one token, got {prompt_tokens}")
    best: LoadPlan | None = None
    recompute = prefill.predict(prompt_tokens, 0)
    for k in range(stored_blocks, -1, -1):
        tokens = min(k * block_tokens, prompt_tokens - 1)
        load_s = load.predict(k * block_bytes)
        total = load_s + prefill.predict(prompt_tokens - tokens, tokens)
        if best is None or total < best.predicted_s:
            best = LoadPlan(k, tokens, total, recompute, load_s)
    assert best is not None
    return best

"""Load or recompute: the cost models a prefill worker decides with, and the decision.

Pure and synchronous: they take measurements as arguments and hold no tensors,
sockets or clocks, so every decision can be replayed in a test.

- :class:`PrefillCostModel`: seconds to compute ``new`` tokens after ``past``
  cached ones, ``a + b*new + c*new*(past + new)`` (a fixed cost per forward, the
  per-token matmuls, attention over the whole context), fitted by non-negative
  least squares on the worker's own recent prefills: the fastest time seen for
  each shape, and a second fit without shapes over twice the first's prediction,
  so that first calls (a GPU picking its kernels) and a noisy neighbour do not
  bend it.
- :class:`LoadCostModel`: seconds to load ``n`` bytes from the store,
  ``latency + n / bandwidth``, fitted on the worker's own recent loads.
- :func:`plan_load`: how many of the stored leading blocks to load so that load
  plus the remaining prefill is shortest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidArgument


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, exactly: the best of the fits on each subset of columns
    whose coefficients all come out non-negative (a handful of columns: 2^n small solves)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b**2))
    for mask in range(1, 1 << n):
        cols = [c for c in range(n) if mask >> c & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (sol < 0).any():
            continue
        x = np.zeros(n)
        x[cols] = sol
        err = float(np.sum((a @ x - b) ** 2))
        if err < best_err:
            best, best_err = x, err
    return best


class PrefillCostModel:
    """Predicted prefill seconds from observed ones: the fastest time of each of the last ``window`` shapes.

    Refits on each observation.
    """

    def __init__(self, window: int = 64) -> None:
        self.window = window
        self._fastest: dict[tuple[int, int], float] = {}  # (new, past) -> fastest seconds; insertion = recency
        self._coef = np.zeros(3)

    @staticmethod
    def _features(new: int, past: int) -> list[float]:
        return [1.0, float(new), float(new) * float(past + new)]

    def observe(self, new: int, past: int, seconds: float) -> None:
        if new <= 0 or past < 0 or seconds < 0:
            raise InvalidArgument(
                f"a prefill sample needs new > 0, past >= 0 and seconds >= 0: {new}, {past}, {seconds}"
            )
        shape = (new, past)
        fastest = min(seconds, self._fastest.pop(shape, seconds))
        self._fastest[shape] = fastest  # re-inserted last: the most recent shapes stay
        while len(self._fastest) > self.window:
            del self._fastest[next(iter(self._fastest))]
        a = np.array([self._features(n, p) for n, p in self._fastest])
        b = np.array(list(self._fastest.values()))
        coef = _nnls(a, b)
        # A shape seen once may carry its first call's cost (a GPU picking kernels for a new length):
        # shapes over twice the fit's prediction are left out of a second fit.
        keep = b <= 2 * (a @ coef) + 1e-4
        if 3 <= keep.sum() < len(b):
            coef = _nnls(a[keep], b[keep])
        self._coef = coef

    @property
    def samples(self) -> int:
        """Shapes the fit rests on."""
        return len(self._fastest)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        a, b, c = (float(x) for x in self._coef)
        return a, b, c

    def predict(self, new: int, past: int) -> float:
        """Seconds to compute ``new`` tokens after ``past`` cached ones (0 for no tokens)."""
        if new <= 0:
            return 0.0
        return float(np.dot(self._coef, self._features(new, past)))


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

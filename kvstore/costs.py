"""Cost models that scheduling decisions rest on: pure, fitted on measurements given as arguments.

:class:`PrefillCostModel` predicts the seconds a prefill takes to compute ``new``
tokens after ``past`` cached ones, ``a + b*new + c*new*(new + 2*past)``: a fixed
cost per forward, the per-token matmuls, and causal attention (token ``i`` of the
new ones attends to ``past + i`` others; summed, ``new*(new + 2*past)/2``). This is
the shape of the FLOP count of a transformer's prefill (Mooncake's
``l*(a*n^2*d + b*n*d^2)`` differenced between ``past + new`` and ``past``), so a
fit on an exact cost model is exact. A prefill worker deciding whether to load
(``kvstore_client.adapters.costs``) and the conductor predicting time to first
token (:mod:`kvstore.scheduling`) share it.
"""

from __future__ import annotations

from typing import Literal

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
    """Predicted prefill seconds from observed ones, one sample per shape for the last ``window`` shapes.

    ``track="fastest"`` keeps each shape's fastest time (what the machine can do when
    nothing else runs: a worker deciding for itself); ``"latest"`` keeps its latest
    (what it does now, neighbours included: the conductor predicting a busy worker).
    Fitted by non-negative least squares, refit on each observation, then once more
    without shapes over twice the first fit's prediction, so that first calls (a GPU
    picking its kernels) and a noisy neighbour do not bend it.
    """

    def __init__(self, window: int = 64, *, track: Literal["fastest", "latest"] = "fastest") -> None:
        if window < 1 or track not in ("fastest", "latest"):
            raise InvalidArgument(f"a prefill model needs window >= 1 and track fastest|latest, got {window}, {track}")
        self.window = window
        self.track = track
        self._fastest: dict[tuple[int, int], float] = {}  # (new, past) -> kept seconds; insertion = recency
        self._coef = np.zeros(3)
        self._abc = (0.0, 0.0, 0.0)  # the coefficients as floats: predict is on the scheduler's hot path

    @staticmethod
    def _features(new: int, past: int) -> list[float]:
        return [1.0, float(new), float(new) * float(new + 2 * past)]

    def observe(self, new: int, past: int, seconds: float) -> None:
        if new <= 0 or past < 0 or seconds < 0:
            raise InvalidArgument(
                f"a prefill sample needs new > 0, past >= 0 and seconds >= 0: {new}, {past}, {seconds}"
            )
        shape = (new, past)
        kept = self._fastest.pop(shape, seconds)
        fastest = min(seconds, kept) if self.track == "fastest" else seconds
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
        self._abc = (float(coef[0]), float(coef[1]), float(coef[2]))

    @property
    def samples(self) -> int:
        """Shapes the fit rests on."""
        return len(self._fastest)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return self._abc

    def predict(self, new: int, past: int) -> float:
        """Seconds to compute ``new`` tokens after ``past`` cached ones (0 for no tokens)."""
        if new <= 0:
            return 0.0
        a, b, c = self._abc
        return a + b * new + c * new * (new + 2 * past)

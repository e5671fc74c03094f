"""The shared-memory copier: every byte lands, whether the batch is copied on one thread or several."""

from __future__ import annotations

import numpy as np
import pytest

from transfer.transports.shm import PARALLEL_BYTES, PIECE_BYTES, Copier


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "sizes", [[100, 5000], [PIECE_BYTES * 2 + 17, 3, PIECE_BYTES - 1, PARALLEL_BYTES], [PARALLEL_BYTES + 1]]
)
def test_every_byte_lands_in_its_destination(threads: int, sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n + 9, dtype=np.uint8) for n in sizes]  # destinations may be longer than their source
    copier = Copier(threads)
    try:
        copier.copy([(memoryview(d), memoryview(s)) for d, s in zip(dsts, srcs, strict=True)])
    finally:
        copier.close()
    for d, s in zip(dsts, srcs, strict=True):
        assert np.array_equal(d[: s.size], s) and not d[s.size :].any()

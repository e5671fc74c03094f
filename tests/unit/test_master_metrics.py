from __future__ import annotations

import pytest

from server.master.metrics import HISTORY_SECONDS, HistorySample, LatencyHistogram, Sampler


def test_a_histogram_counts_each_observation_in_its_bucket_cumulatively() -> None:
    h = LatencyHistogram()
    for seconds in (0.00005, 0.0002, 0.0002, 0.003, 5.0):
        h.observe(seconds)
    buckets = dict(h.buckets())
    assert buckets["0.0001"] == 1 and buckets["0.00025"] == 3 and buckets["0.001"] == 3
    assert buckets["0.005"] == 4 and buckets["1.0"] == 4 and buckets["+Inf"] == 5
    assert [b for b, _ in h.buckets()][-1] == "+Inf" and h.total == pytest.approx(5.00345)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def counters(hits: int, misses: int, gets: int = 0) -> dict[str, int]:
    return {"hits": hits, "misses": misses, "gets": gets, "puts": 0, "bytes_read": 0, "bytes_written": 0}


def test_the_sampler_is_due_once_a_second_by_its_clock() -> None:
    clock = Clock()
    s = Sampler(clock)
    assert s.due()
    s.sample(counters(0, 0), 0, 0)
    clock.t += 0.999
    assert not s.due()
    clock.t += 0.001
    assert s.due()


def test_rates_and_history_between_samples() -> None:
    clock = Clock()
    s = Sampler(clock)
    assert s.rates() == dict.fromkeys(
        ("hit_rate", "gets_per_s", "puts_per_s", "hits_per_s", "read_bytes_per_s", "written_bytes_per_s"), 0.0
    )
    s.sample(counters(0, 0), 10, 0)
    clock.t += 2
    s.sample(counters(30, 10, gets=40), 20, 5)
    clock.t += 1
    s.sample(counters(30, 10, gets=40), 30, 5)
    assert s.rates()["hit_rate"] == pytest.approx(30 / 40) and s.rates()["gets_per_s"] == pytest.approx(40 / 3)
    assert s.rates(window=1)["gets_per_s"] == 0.0
    first, second = s.history()
    assert first == HistorySample(1002.0, 0.75, 20.0, 0.0, 0.0, 0.0, 20, 5)
    assert second.hit_rate is None and second.dram_used == 30  # no lookups in that second


def test_the_history_keeps_its_last_seconds() -> None:
    clock = Clock()
    s = Sampler(clock)
    for _ in range(HISTORY_SECONDS + 10):
        s.sample(counters(0, 0), 0, 0)
        clock.t += 1
    assert len(s.history()) == HISTORY_SECONDS

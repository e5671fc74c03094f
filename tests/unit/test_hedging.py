"""The hedge patience: MULTIPLE x the recent p99 read time, within [FLOOR_S, failover], and a budget of hedges."""

from __future__ import annotations

from kvstore_client.hedging import BUDGET, EVERY, FLOOR_S, MULTIPLE, WINDOW, ReadTimes


def test_no_hedging_until_enough_reads_are_known() -> None:
    times = ReadTimes(0.1)
    for _ in range(WINDOW // 4 - 1):
        times.add(0.001)
    assert times.patience_s == 0.1


def test_the_patience_is_the_p99_within_its_bounds() -> None:
    times = ReadTimes(0.1)
    for i in range(WINDOW):
        times.add(0.030 if i % 100 == 99 else 0.003)  # 1% slow: the p99 is one of the fast
    assert times.patience_s == MULTIPLE * 0.003
    for _ in range(WINDOW):
        times.add(0.0001)  # faster than a give-up is worth
    assert times.patience_s == FLOOR_S
    for _ in range(WINDOW):
        times.add(1.0)  # slower than failover: never more than it
    assert times.patience_s == 0.1


def test_over_budget_reads_wait_the_failover_until_the_window_ends() -> None:
    times = ReadTimes(0.1)
    for _ in range(WINDOW):
        times.add(0.003)
    hedge = MULTIPLE * 0.003
    allowed = int(BUDGET * WINDOW)
    for _ in range(allowed):
        times.gave_up(times.patience_s)
    assert times.patience_s == hedge
    times.gave_up(times.patience_s)
    assert times.patience_s == 0.1 and times.hedged == allowed + 1
    for _ in range(WINDOW + EVERY):  # a new window: hedging again
        times.add(0.003)
    assert times.patience_s == hedge


def test_give_ups_at_the_failover_are_no_hedges_and_hedging_can_be_off() -> None:
    times = ReadTimes(0.1)
    times.gave_up(0.1)
    assert times.hedged == 0
    off = ReadTimes(0.1, enabled=False)
    for _ in range(WINDOW):
        off.add(0.003)
    assert off.patience_s == 0.1
    assert ReadTimes(0.004).patience_s == 0.004  # failover below the floor: no hedging

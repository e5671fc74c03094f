"""The circuit breaker that keeps an engine from waiting on a sick store."""

from __future__ import annotations

import pytest

from kvstore_client.adapters.health import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failure_opens_the_breaker_and_one_probe_per_cooldown_goes_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker(cooldown_s=2.0, max_cooldown_s=5.0, clock=clock)
    assert breaker.is_closed and breaker.allow() and breaker.allow()
    breaker.failure()
    assert not breaker.is_closed and not breaker.allow() and breaker.trips == 1
    clock.now += 1.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one while it is out
    breaker.failure()  # the probe failed: open twice as long
    clock.now += 3.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow()
    breaker.failure()  # 8 s would be past the cap: 5 s
    clock.now += 5.1
    assert breaker.allow()
    breaker.success()
    assert breaker.is_closed and breaker.allow() and breaker.trips == 3
    breaker.failure()  # closed again, so the cooldown starts over at 2 s
    clock.now += 2.1
    assert breaker.allow()


def test_failures_of_calls_started_while_closed_count_once() -> None:
    clock = Clock()
    breaker = CircuitBreaker(cooldown_s=1.0, clock=clock)
    for _ in range(5):
        breaker.failure()
    assert breaker.trips == 1
    clock.now += 1.1
    assert breaker.allow()


def test_cooldowns_must_make_sense() -> None:
    with pytest.raises(ValueError, match="cooldown"):
        CircuitBreaker(cooldown_s=0)
    with pytest.raises(ValueError, match="cooldown"):
        CircuitBreaker(cooldown_s=10, max_cooldown_s=5)

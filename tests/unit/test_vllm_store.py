"""The vLLM connector's store behind its circuit breaker (``vllm_store.py``), without vLLM: a fake
store client stands in for the master, and the breaker runs on the test's clock."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest

from kvstore.config import ClientConfig
from kvstore.errors import ConnectionFailed
from kvstore_client.adapters import vllm_store
from kvstore_client.adapters.health import CircuitBreaker
from kvstore_client.adapters.vllm_store import GuardedStore, repair


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """What the guarded store and :func:`repair` call of a ``Store``, recorded."""

    def __init__(self, master: str, config: ClientConfig) -> None:
        self.master, self.config = master, config
        self.answers = True
        self.calls: list[tuple[str, Any]] = []

    def stats(self) -> dict[str, int]:
        self.calls.append(("stats", None))
        if not self.answers:
            raise ConnectionFailed("nobody there")
        return {}

    def remove_many(self, keys: Sequence[str]) -> None:
        self.calls.append(("remove_many", list(keys)))

    def close(self) -> None:
        self.calls.append(("close", None))


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[FakeStore]:
    made: list[FakeStore] = []

    def connect(master: str, config: ClientConfig) -> FakeStore:
        made.append(FakeStore(master, config))
        return made[-1]

    monkeypatch.setattr(vllm_store.Store, "connect", connect)
    return made


def test_the_client_connects_once_on_first_use_with_the_roles_timeout_and_put_mode(connects: list[FakeStore]) -> None:
    guarded = GuardedStore("10.0.0.1:50051", timeout_s=1.5, put_mode="visible")
    assert guarded.available() and guarded.connected is None and not connects  # asking connects nothing
    client = guarded.client
    assert guarded.client is client and guarded.connected is client and len(connects) == 1
    assert connects[0].master == "10.0.0.1:50051"
    assert connects[0].config == ClientConfig(timeout_s=1.5, put_mode="visible")
    guarded.close()
    assert connects[0].calls == [("close", None)] and guarded.connected is None


def test_a_failure_skips_the_store_until_a_probe_in_the_background_finds_it_again(
    connects: list[FakeStore], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    guarded = GuardedStore("m:1", timeout_s=5.0, put_mode="cached", breaker=CircuitBreaker(2.0, 60.0, clock))
    client = guarded.client
    with caplog.at_level(logging.INFO, logger="kvstore_client.adapters.vllm"):
        guarded.failed(ConnectionFailed("reset"), "looking up request r1")
        guarded.failed(ConnectionFailed("reset"), "loading KV of request r1")  # the same trip: said once
        assert not guarded.available() and guarded._probe is None  # in the cooldown: skipped, no probe
        clock.now += 2.1
        client.answers = False
        assert not guarded.available()  # the probe goes in the background; this call still skips
        assert guarded._probe is not None
        guarded._probe.join(5)
        assert not guarded.breaker.is_closed and guarded.breaker.trips == 2  # it failed: open twice as long
        clock.now += 4.1
        client.answers = True
        assert not guarded.available()
        guarded._probe.join(5)
        assert guarded.breaker.is_closed and guarded.available()
    assert [call for call, _ in client.calls] == ["stats", "stats"]  # the two probes, nothing else
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["looking up request r1 failed, skipping the store for 2 s: reset"]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["store still unavailable: nobody there", "store m:1 answers again: using it"]


def test_repair_removes_only_the_blocks_of_the_wrong_size(connects: list[FakeStore]) -> None:
    store = FakeStore("m:1", ClientConfig())
    assert repair(store, ["a", "b", "c", "d"], [64, None, 32, 64], 64) == 1
    assert store.calls == [("remove_many", ["c"])]
    assert repair(store, ["a", "b"], [64, None], 64) == 0
    assert store.calls == [("remove_many", ["c"])]  # nothing to remove: no call

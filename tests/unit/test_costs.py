"""Load or recompute: the cost models and the plan, with measurements given, not taken."""

from __future__ import annotations

import pytest

from kvstore.costs import PrefillCostModel
from kvstore.errors import InvalidArgument
from kvstore_client.adapters.costs import LoadCostModel, plan_load


def fitted(a: float = 0.01, b: float = 1e-3, c: float = 1e-7) -> PrefillCostModel:
    """A prefill model fitted on exact samples of ``a + b*new + c*new*(new + 2*past)``."""
    model = PrefillCostModel()
    for new, past in [(64, 0), (128, 0), (256, 0), (512, 0), (128, 256), (64, 1024)]:
        model.observe(new, past, a + b * new + c * new * (new + 2 * past))
    return model


def test_prefill_model_recovers_its_coefficients() -> None:
    model = fitted()
    a, b, c = model.coefficients
    assert a == pytest.approx(0.01, rel=1e-6) and b == pytest.approx(1e-3, rel=1e-6) and c == pytest.approx(1e-7)
    assert model.predict(1000, 1000) == pytest.approx(0.01 + 1.0 + 0.3, rel=1e-6)
    assert model.predict(0, 500) == 0.0


def test_prefill_model_never_goes_negative() -> None:
    model = PrefillCostModel()
    # Noisy samples that an unconstrained fit would answer with a negative fixed cost.
    for new, seconds in [(10, 0.001), (20, 0.0021), (40, 0.0043), (80, 0.0088)]:
        model.observe(new, 0, seconds)
    assert all(x >= 0 for x in model.coefficients)
    assert model.predict(1, 0) >= 0
    with pytest.raises(InvalidArgument):
        model.observe(0, 0, 1.0)


def test_load_model_learns_bandwidth_and_latency() -> None:
    load = LoadCostModel(latency_s=0.001, bytes_per_s=1e9)
    for _ in range(20):
        load.observe_latency(0.0005)
    assert load.latency_s == pytest.approx(0.0005, rel=1e-3)
    load.observe(100_000_000, 0.0005 + 0.05)  # 2 GB/s once the round trip is taken off
    assert load.bytes_per_s == pytest.approx(2e9, rel=1e-4)
    assert load.predict(2_000_000_000) == pytest.approx(1.0005, rel=1e-3)
    assert load.predict(0) == 0.0


def test_plan_loads_the_whole_hit_when_the_store_is_fast() -> None:
    plan = plan_load(2048, 6, 256, 2 << 20, fitted(), LoadCostModel(latency_s=0.001, bytes_per_s=5e9))
    assert plan.blocks == 6 and plan.tokens == 1536
    assert plan.predicted_s < plan.recompute_s
    assert plan.deadline_s == pytest.approx(plan.recompute_s - (plan.predicted_s - plan.load_s))


def test_plan_recomputes_when_loading_is_slower_than_computing() -> None:
    plan = plan_load(2048, 6, 256, 2 << 20, fitted(), LoadCostModel(latency_s=0.001, bytes_per_s=1e6))
    assert plan.blocks == 0 and plan.tokens == 0 and plan.predicted_s == pytest.approx(plan.recompute_s)


def test_plan_keeps_one_token_to_compute_on_a_full_hit() -> None:
    plan = plan_load(512, 2, 256, 1 << 20, fitted(), LoadCostModel(latency_s=0.0, bytes_per_s=1e12))
    assert plan.blocks == 2 and plan.tokens == 511


def test_an_uncalibrated_worker_recomputes() -> None:
    # With no prefill samples nothing is known to be saved by loading: the plan is to compute.
    assert plan_load(2048, 8, 256, 1 << 20, PrefillCostModel(), LoadCostModel()).blocks == 0
    with pytest.raises(InvalidArgument):
        plan_load(0, 0, 256, 1, PrefillCostModel(), LoadCostModel())


def test_first_call_outliers_do_not_bend_the_prefill_fit() -> None:
    # A GPU's first call at each shape picks its kernels and takes far longer; later calls are fast.
    model = PrefillCostModel()
    truth = fitted()
    for new, past in [(256, 0), (512, 0), (1024, 0), (256, 512), (2048, 0), (512, 1536)]:
        model.observe(new, past, 10 * truth.predict(new, past) + 1.0)  # cold
        for _ in range(3):
            model.observe(new, past, truth.predict(new, past))
    assert model.samples == 6
    for new, past in [(2048, 0), (512, 1536), (1024, 1024)]:
        assert model.predict(new, past) == pytest.approx(truth.predict(new, past), rel=1e-6)


def test_the_fit_keeps_the_most_recent_shapes() -> None:
    model = PrefillCostModel(window=3)
    for new in (10, 20, 30, 40):
        model.observe(new, 0, new * 1e-3)
    assert model.samples == 3


def test_a_shape_seen_only_cold_is_left_out_of_the_fit() -> None:
    model = PrefillCostModel()
    truth = fitted()
    for new, past in [(256, 0), (512, 0), (1024, 0), (256, 512), (2048, 0)]:
        model.observe(new, past, truth.predict(new, past))
    model.observe(1536, 0, 50 * truth.predict(1536, 0))  # once, on its first call
    assert model.predict(2048, 0) == pytest.approx(truth.predict(2048, 0), rel=1e-6)


def test_latest_tracking_follows_a_slower_machine() -> None:
    fastest, latest = PrefillCostModel(), PrefillCostModel(track="latest")
    shapes = [(256, 0), (512, 0), (1024, 0), (256, 512)]
    truth = fitted()
    for scale in (1.0, 2.0):  # a neighbour starts and every prefill takes twice as long
        for new, past in shapes:
            for model in (fastest, latest):
                model.observe(new, past, scale * truth.predict(new, past))
    assert fastest.predict(1024, 0) == pytest.approx(truth.predict(1024, 0), rel=1e-6)
    assert latest.predict(1024, 0) == pytest.approx(2 * truth.predict(1024, 0), rel=1e-6)
    with pytest.raises(InvalidArgument):
        PrefillCostModel(track="slowest")  # type: ignore[arg-type]

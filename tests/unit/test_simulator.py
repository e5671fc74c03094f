"""The trace simulator: cost model, cache behaviour, metrics, and the paper's orderings on the shared trace."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.scheduling import Slo
from kvstore.simulator import ClusterCost, SimConfig, _slowest_tenth, simulate, sweep
from kvstore.workload import TraceRequest, chat_workload, load_trace

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "synthetic_trace.jsonl"


def test_cost_model_follows_the_paper() -> None:
    cost = ClusterCost()
    assert cost.kv_bytes_per_token == 327_680  # 320 KB per token for LLaMA3-70B
    assert cost.prefill_s(1000, 3000) == pytest.approx((cost.flops(4000) - cost.flops(3000)) / (cost.gpu_flops * 0.5))
    assert cost.prefill_s(0, 100) == 0
    fitted = cost.fitted_prefill_model()
    for new, past in [(512, 0), (8000, 12000), (30000, 1000)]:
        assert fitted.predict(new, past) == pytest.approx(cost.prefill_s(new, past), rel=1e-6)
    with pytest.raises(InvalidArgument):
        ClusterCost(mfu=0)
    with pytest.raises(InvalidArgument, match="no HBM"):
        ClusterCost(hbm_bytes=1e9)


def test_slowest_tenth_of_intervals() -> None:
    assert _slowest_tenth([[0.01, 90.0], [0.05, 10.0]]) == pytest.approx(0.05)
    assert _slowest_tenth([[0.01, 95.0], [0.05, 5.0]]) == pytest.approx((5 * 0.05 + 5 * 0.01) / 10)
    assert _slowest_tenth([]) == 0.0


def two_requests(gap_ms: int = 60_000) -> list[TraceRequest]:
    shared = tuple(range(8))
    return [TraceRequest(0, 8 * 512 + 100, 20, (*shared, 100)), TraceRequest(gap_ms, 8 * 512 + 100, 20, (*shared, 200))]


def test_a_shared_prefix_is_reused_and_metrics_add_up() -> None:
    row = simulate(two_requests(), SimConfig(prefill=2, decode=1))
    assert row["requests"] == 2 and row["rejected"] == 0
    assert row["hit_rate"] == pytest.approx(8 * 512 / (2 * (8 * 512 + 100)), abs=1e-4)
    assert 0 < row["mean_ttft_s"] < 2 and row["p90_tbt_s"] > 0 and row["slo_attainment"] == 1.0
    assert row["median_ttft_prediction_error"] < 1e-6  # the scheduler's fitted model is exact here
    assert simulate(two_requests(), SimConfig(prefill=2, decode=1, cache_tokens=0))["hit_rate"] == 0.0


def test_the_global_pool_serves_a_prefix_held_on_a_busy_node() -> None:
    # The first request's node is still busy with a long prompt when the second arrives: global
    # fetches the prefix to the idle node, local recomputes it there.
    reqs = [
        TraceRequest(0, 8 * 512 + 100, 2, (*range(8), 100)),
        TraceRequest(5_000, 60_000, 2, tuple(range(1000, 1118))),
        TraceRequest(5_010, 8 * 512 + 100, 2, (*range(8), 200)),
    ]
    glob = simulate(reqs, SimConfig(prefill=2, decode=1))
    local = simulate(reqs, SimConfig(prefill=2, decode=1, scheduler="local"))
    assert glob["hit_rate"] > local["hit_rate"]


def test_simulation_is_deterministic_and_rejects_bad_config() -> None:
    reqs = chat_workload(num_sessions=40, seed=3)
    config = SimConfig(prefill=4, decode=2, scheduler="random", speed=20.0)
    assert simulate(reqs, config) == simulate(reqs, config)
    with pytest.raises(InvalidArgument):
        SimConfig(scheduler="best")
    with pytest.raises(InvalidArgument):
        SimConfig(prefill=0)
    with pytest.raises(InvalidArgument):
        sweep([], config, ["global"], [1.0])


def test_early_rejection_turns_requests_away_before_prefill() -> None:
    reqs = chat_workload(num_sessions=60, seed=1)
    base = SimConfig(prefill=2, decode=1, speed=50.0, slo=Slo(ttft_s=5.0, tbt_s=0.1))
    late = simulate(reqs, replace(base, early_rejection=True, decode_load="none"))
    early = simulate(reqs, replace(base, early_rejection=True, decode_load="predicted"))
    for row in (late, early):
        assert row["rejected"] > 0
    assert early["rejected_at_decode"] <= late["rejected_at_decode"]


def test_sweep_reports_the_request_rate() -> None:
    rows = sweep(chat_workload(num_sessions=10, seed=2), SimConfig(prefill=2, decode=1), ["global", "load"], [1, 2])
    assert [r["scheduler"] for r in rows] == ["global", "load", "global", "load"]
    assert rows[2]["request_rate"] == pytest.approx(2 * rows[0]["request_rate"])


@pytest.mark.skipif(not TRACE.exists(), reason="shared/traces/synthetic_trace.jsonl is not present")
def test_the_papers_ordering_on_the_shared_trace() -> None:
    reqs = list(load_trace(TRACE))
    ttft = {name: simulate(reqs, SimConfig(scheduler=name))["mean_ttft_s"] for name in ("global", "local", "load")}
    ttft["random"] = simulate(reqs, SimConfig(scheduler="random"))["mean_ttft_s"]
    assert ttft["global"] < ttft["local"] < ttft["load"] < ttft["random"]


def test_extreme_times_and_costs_end_instead_of_spinning() -> None:
    # Epoch-millisecond stamps next to relative ones, and a decode step below float resolution at that time.
    reqs = [TraceRequest(0, 1000, 50, (1,)), TraceRequest(1_700_000_000_000, 1000, 50, (1,))]
    assert simulate(reqs, SimConfig(prefill=1, decode=1))["requests"] == 2
    fast = SimConfig(prefill=1, decode=1, cost=ClusterCost(hbm_bytes_per_s=1e22))
    assert simulate([TraceRequest(0, 1000, 50, (1,)), TraceRequest(10, 1000, 50, (1,))], fast)["rejected"] == 0


@pytest.mark.parametrize(
    "bad", [{"gqa": 100_000}, {"layers": float("nan")}, {"hbm_bytes": float("inf")}, {"attn_coef": -1.0}]
)
def test_bad_cost_constants_are_a_typed_error(bad: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        ClusterCost(**bad)  # type: ignore[arg-type]


def test_lru_keeps_the_head_of_a_chain() -> None:
    # One node caching 3 blocks: a 4-block prompt keeps its first 3, so its repeat hits them.
    reqs = [TraceRequest(0, 4 * 512 + 1, 2, (1, 2, 3, 4, 5)), TraceRequest(60_000, 4 * 512 + 1, 2, (1, 2, 3, 4, 5))]
    row = simulate(reqs, SimConfig(prefill=1, decode=1, cache_tokens=3 * 512))
    assert row["hit_rate"] == pytest.approx(3 * 512 / (2 * (4 * 512 + 1)), abs=1e-4)

"""The conductor's scheduling core: choices, queues, fetch-or-recompute, early rejection, bad input."""

from __future__ import annotations

import pytest

from kvstore.costs import PrefillCostModel
from kvstore.errors import InvalidArgument, NoNodes
from kvstore.scheduling import DecodeModel, Locality, Request, Scheduler, Slo, TransferModel

PER_TOKEN = 1e-3  # a prefill costs 1 ms per token computed, nothing else


def linear_model() -> PrefillCostModel:
    model = PrefillCostModel()
    for new, past in [(100, 0), (200, 0), (400, 0), (100, 500), (300, 1000)]:
        model.observe(new, past, PER_TOKEN * new)
    return model


def scheduler(policy: str = "global", *, prefill: int = 2, decode: int = 1, **kw: object) -> Scheduler:
    kw.setdefault("transfer", TransferModel(bytes_per_token=1000, remote_bytes_per_s=1e8, local_bytes_per_s=1e9))
    kw.setdefault("decode_model", DecodeModel(base_s=0.01, per_token_s=1e-6, capacity_tokens=100_000))
    s = Scheduler(prefill_model=linear_model(), policy=policy, **kw)  # type: ignore[arg-type]
    for i in range(prefill):
        s.add_prefill(f"p{i}", node=f"n{i}")
    for i in range(decode):
        s.add_decode(f"d{i}")
    return s


def test_global_prefers_the_instance_holding_the_prefix() -> None:
    s = scheduler()
    d = s.schedule(Request(1, 1000, 10), Locality(800, {"n1": 800}), now=0.0)
    assert d.accepted and d.prefill == "p1" and d.decode == "d0"
    assert d.local_tokens == 800 and d.prefix_tokens == 800 and d.fetch_tokens == 0
    assert d.prefill_s == pytest.approx(0.2 + 800 * 1000 / 1e9)
    assert d.queue_s == 0 and d.ttft_s == pytest.approx(d.prefill_s)


def test_a_cost_model_that_cannot_tell_keeps_the_request_where_its_prefix_is() -> None:
    # A fit flat in tokens (a tiny model's time to first token is its fixed cost) predicts the same for
    # computing 1416 tokens as for 392 after 1024 held: the instance holding the prefix must still win,
    # whichever order the instances are in (it once lost by the 1 us its free cache was charged).
    flat = PrefillCostModel()
    for new, past in [(100, 0), (200, 0), (400, 0), (100, 500)]:
        flat.observe(new, past, 0.05)
    assert flat.coefficients[1:] == (0.0, 0.0)
    for holder in ("e0", "e1"):
        s = Scheduler(prefill_model=flat, transfer=TransferModel(1024, 1e9, float("inf")),
                      decode_model=DecodeModel(base_s=0.01), colocated=True)  # fmt: skip
        for name in ("e0", "e1"):
            s.add_prefill(name, node=name)
            s.add_decode(name)
        for stored in (0, 1024):
            d = s.schedule(Request(stored + 1, 1416, 16), Locality(stored, {holder: 1024}), now=0.0)
            assert d.prefill == holder and d.local_tokens == 1024 and d.fetch_tokens == 0
            s.forget(stored + 1, 0.0)


def test_load_balancing_stays_blind_to_the_cache_on_a_tie() -> None:
    d = scheduler("load").schedule(Request(1, 1000, 10), Locality(800, {"n1": 800}), now=0.0)
    assert d.prefill == "p0"  # both idle: the first, though p1 holds the prefix


def test_global_fetches_a_longer_remote_prefix_and_local_does_not() -> None:
    s, loc = scheduler(replicate_max_tokens=100), Locality(800, {"n1": 800})
    s.schedule(Request(1, 1000, 10), Locality(0, {}), now=0.0)  # p0 busy for 1 s
    s.schedule(Request(2, 1000, 10), Locality(0, {}), now=0.0)  # p1 busy for 1 s too
    busy = s.schedule(Request(3, 1000, 10), loc, now=0.0)
    # Both queues hold 1 s; p1 holds the prefix, so it wins without fetching.
    assert busy.prefill == "p1" and busy.fetch_tokens == 0
    s2 = scheduler(replicate_max_tokens=100)
    s2.prefill["p1"].jobs, s2.prefill["p1"].backlog_s = {99: 5.0}, 5.0  # p1 holds the prefix but is busy 5 s
    d = s2.schedule(Request(2, 1000, 10), loc, now=0.0)
    assert d.prefill == "p0" and d.fetch_tokens == 800 and d.prefix_tokens == 800
    assert d.transfer_s == pytest.approx(800 * 1000 / 1e8) and d.replicate_tokens == 100
    local = scheduler("local")
    local.prefill["p1"].jobs, local.prefill["p1"].backlog_s = {99: 5.0}, 5.0
    d = local.schedule(Request(2, 1000, 10), loc, now=0.0)
    assert d.prefill == "p0" and d.fetch_tokens == 0 and d.prefix_tokens == 0


def test_the_balancing_threshold_keeps_a_near_local_prefix() -> None:
    s = scheduler(balancing_threshold=2.0, prefill=1)
    d = s.schedule(Request(1, 1000, 10), Locality(700, {"n0": 400}), now=0.0)
    assert d.prefill == "p0" and d.fetch_tokens == 0  # 700 < 2 x 400: recompute rather than fetch
    s = scheduler(balancing_threshold=1.5, prefill=1)
    d = s.schedule(Request(1, 1000, 10), Locality(700, {"n0": 400}), now=0.0)
    assert d.fetch_tokens == 300


def test_queue_time_counts_what_is_queued_and_what_has_run() -> None:
    s = scheduler("load", prefill=1)
    a = s.schedule(Request(1, 1000, 10), Locality(0, {}), now=0.0)
    b = s.schedule(Request(2, 500, 10), Locality(0, {}), now=0.0)
    assert a.queue_s == 0 and b.queue_s == pytest.approx(1.0)
    p = s.prefill["p0"]
    assert p.queue_s(0.4) == pytest.approx(1.1)  # 0.6 left of the first, then 0.5
    assert p.queue_s(5.0) == pytest.approx(0.5)  # the first overran its prediction: its rest counts as 0
    s.prefill_done(1, now=1.2)
    assert p.queue_s(1.2) == pytest.approx(0.5) and p.queue_s(1.5) == pytest.approx(0.2)
    s.prefill_done(2, now=1.7)
    assert p.queue_s(2.0) == 0 and s.in_flight == 2  # both decoding


def test_load_balancing_ignores_where_the_cache_is() -> None:
    s = scheduler("load")
    s.schedule(Request(1, 1000, 10), Locality(0, {}), now=0.0)
    d = s.schedule(Request(2, 1000, 10), Locality(900, {"n0": 900}), now=0.0)
    assert d.prefill == "p1"  # the idle one, though p0 holds 900 tokens of the prompt


def test_early_rejection_on_ttft() -> None:
    s = scheduler(early_rejection=True, slo=Slo(ttft_s=1.5, tbt_s=1.0), prefill=1)
    assert s.schedule(Request(1, 1000, 10), Locality(0, {}), now=0.0).accepted
    d = s.schedule(Request(2, 1000, 10), Locality(0, {}), now=0.0)
    assert not d.accepted and d.reason == "ttft" and d.ttft_s == pytest.approx(2.0)
    assert s.in_flight == 1  # a rejected request holds no queue


def test_predicted_decode_load_counts_prefills_that_end_first() -> None:
    decode = DecodeModel(base_s=0.01, capacity_tokens=2500)
    for mode, accepted in (("current", True), ("predicted", False)):
        s = scheduler(early_rejection=True, decode_load=mode, decode_model=decode, prefill=3)
        s.schedule(Request(1, 1000, 0), Locality(0, {}), now=0.0)  # ends its prefill at 1.0
        s.schedule(Request(2, 1000, 0), Locality(0, {}), now=0.0)  # on another instance, also at 1.0
        # A third ends its prefill at 1.0 too: the KV room (2,500 tokens) then holds two.
        d = s.schedule(Request(3, 1000, 0), Locality(0, {}), now=0.0)
        assert d.accepted is accepted, mode
        if not accepted:
            assert d.reason == "kv" and d.decode_load == pytest.approx(3000 / 2500)


def test_predicted_load_drops_requests_whose_decode_has_ended() -> None:
    s = scheduler(early_rejection=True, decode_load="predicted", prefill=2, decode_time_s=0.5,
                  decode_model=DecodeModel(base_s=0.01, capacity_tokens=2500))  # fmt: skip
    s.schedule(Request(1, 1000, 0), Locality(0, {}), now=0.0)
    s.prefill_done(1, now=1.0)  # decoding from 1.0; with t_d = 0.5 it is predicted gone by 1.5
    s.schedule(Request(2, 1000, 0), Locality(0, {}), now=1.0)  # on p0, ends its prefill at 2.0
    # Request 3 ends its prefill at 2.0 too, after request 1's decode is predicted over.
    d = s.schedule(Request(3, 1000, 0), Locality(0, {}), now=1.0)
    assert d.accepted and d.decode_load == pytest.approx(2000 / 2500)
    current = scheduler(early_rejection=True, decode_load="current", prefill=2,
                        decode_model=DecodeModel(base_s=0.01, capacity_tokens=2500))  # fmt: skip
    current.schedule(Request(1, 1000, 0), Locality(0, {}), now=0.0)
    current.prefill_done(1, now=1.0)
    current.schedule(Request(2, 1000, 0), Locality(0, {}), now=1.0)
    assert current.schedule(Request(3, 1000, 0), Locality(0, {}), now=1.0).accepted  # it sees only request 1


def test_decode_side_admission_and_forget() -> None:
    s = scheduler(decode_model=DecodeModel(base_s=0.01, capacity_tokens=2500), prefill=3)
    for rid in (1, 2, 3):
        assert s.schedule(Request(rid, 1000, 0), Locality(0, {}), now=0.0).accepted  # no early rejection
    for rid in (1, 2):
        assert s.decode_admits(rid)
        s.prefill_done(rid, now=1.0)
    assert not s.decode_admits(3)  # the decode side turns it away: its prefill is wasted
    s.forget(3, now=1.0)
    assert s.in_flight == 2 and s.decode["d0"].active_tokens == 2000
    s.decode_done(1, now=3.0)
    assert s.decode["d0"].active_count == 1 and s.decode_time_s < 10.0  # t_d learns from the 2 s decode
    assert s.decode_admits(2) is True or s.decode["d0"].active_tokens == 1000


def test_down_instances_and_exclusions_are_skipped() -> None:
    s = scheduler()
    s.set_up("p1", False)
    assert s.schedule(Request(1, 100, 1), Locality(50, {"n1": 50}), now=0.0).prefill == "p0"
    assert s.schedule(Request(2, 100, 1), Locality(0, {}), now=0.0, exclude=["p1"]).prefill == "p0"
    with pytest.raises(NoNodes):
        s.schedule(Request(3, 100, 1), Locality(0, {}), now=0.0, exclude=["p0"])
    s.set_up("d0", False)
    with pytest.raises(NoNodes):
        s.schedule(Request(4, 100, 1), Locality(0, {}), now=0.0)


def test_bad_input_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgument, match="unknown scheduling policy"):
        scheduler("fastest")
    with pytest.raises(InvalidArgument):
        scheduler(decode_load="soon")
    with pytest.raises(InvalidArgument):
        Request(1, 0, 1)
    with pytest.raises(InvalidArgument):
        Slo(ttft_s=0)
    s = Scheduler(prefill_model=linear_model(), transfer=TransferModel(1, 1.0, 1.0),
                  decode_model=DecodeModel(0.01))  # fmt: skip
    s.add_prefill("small", max_tokens=100)
    s.add_decode("d")
    with pytest.raises(InvalidArgument, match="longer than any prefill instance"):
        s.schedule(Request(1, 101, 1), Locality(0, {}), now=0.0)
    with pytest.raises(InvalidArgument):
        s.add_prefill("small")
    s.schedule(Request(1, 50, 1), Locality(0, {}), now=0.0)
    with pytest.raises(InvalidArgument, match="already scheduled"):
        s.schedule(Request(1, 50, 1), Locality(0, {}), now=0.0)
    with pytest.raises(InvalidArgument):
        s.set_up("nobody", False)


def test_random_spreads_and_is_seeded() -> None:
    picks = []
    for _ in range(2):
        s = scheduler("random", prefill=4, decode=4, seed=7)
        picks.append([s.schedule(Request(i, 100, 1), Locality(0, {}), now=0.0).prefill for i in range(40)])
    assert picks[0] == picks[1] and len(set(picks[0])) == 4


def test_an_engine_that_prefills_and_decodes_is_marked_down_in_both_roles() -> None:
    s = scheduler(prefill=0, decode=0)
    for name in ("e0", "e1"):  # OpenAI servers: one instance of each role under one name, on a node of its own
        s.add_prefill(name, node=name)
        s.add_decode(name)
    s.set_up("e0", False)
    assert not s.prefill["e0"].up and not s.decode["e0"].up
    d = s.schedule(Request(1, 1000, 8), Locality(800, {"e0": 800}), now=0.0)
    assert (d.prefill, d.decode, d.local_tokens) == ("e1", "e1", 0)
    s.set_up("e0", True)
    d = s.schedule(Request(2, 1000, 8), Locality(800, {"e0": 800}), now=0.0)
    assert (d.prefill, d.local_tokens) == ("e0", 800)  # the server whose own cache holds the prefix

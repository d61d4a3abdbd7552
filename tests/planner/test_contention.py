"""Stages that slow each other: overlap shares, the fixed point, and the cost model that uses it."""

from __future__ import annotations

import pytest

from gpipe_lab.pipeline import Event, Timeline, get_schedule
from gpipe_lab.planner import StageCosts, predict_step
from gpipe_lab.planner.contention import busy_shares, predict_contended
from gpipe_lab.planner.cost_model import CostModel


def gpipe_costs(K: int, M: int, f: float = 1.0, b: float = 2.0) -> dict[tuple[int, str, int], float]:
    return {(k, kind, i): (f if kind == "F" else b) for k in range(K) for i in range(M) for kind in "FB"}


def test_busy_shares_count_only_other_stages_work():
    tl = Timeline(2, 0.0, 4.0, [Event(0, "F", 0, 0.0, 2.0), Event(1, "wait", 0, 0.0, 1.0),
                                Event(1, "F", 0, 1.0, 3.0), Event(0, "B", 0, 3.0, 4.0)])
    shares = busy_shares(tl)
    assert shares[(0, "F", 0)] == pytest.approx(0.5)  # stage 1 computes over [1, 2] of [0, 2]
    assert shares[(1, "F", 0)] == pytest.approx(0.5)
    assert shares[(0, "B", 0)] == 0.0
    assert (1, "wait", 0) not in shares


def test_equal_costs_or_one_stage_give_the_plain_simulation():
    for K, M in ((1, 4), (2, 4), (3, 6)):
        plan, costs = get_schedule("gpipe", K, M), StageCosts.uniform(K, 1.0, 2.0, 0.0)
        alone = gpipe_costs(K, M)
        plain = predict_step(plan, costs, durations=alone)
        assert predict_contended(plan, costs, alone, alone).step_time == pytest.approx(plain.step_time)
    one = get_schedule("gpipe", 1, 4)
    slow = {key: 5 * v for key, v in gpipe_costs(1, 4).items()}
    assert predict_contended(one, StageCosts.uniform(1), gpipe_costs(1, 4), slow).step_time == pytest.approx(12.0)


def test_one_micro_batch_never_overlaps_so_contention_costs_nothing():
    plan, costs = get_schedule("gpipe", 2, 1), StageCosts.uniform(2, 1.0, 2.0, 0.0)
    slow = {key: 3 * v for key, v in gpipe_costs(2, 1).items()}
    assert predict_contended(plan, costs, gpipe_costs(2, 1), slow).step_time == pytest.approx(6.0)


def test_the_prediction_is_a_fixed_point_between_alone_and_contended():
    K, M = 2, 8
    plan, costs = get_schedule("gpipe", K, M), StageCosts.uniform(K, 1.0, 2.0, 0.0)
    alone = gpipe_costs(K, M)
    slow = {key: 2 * v for key, v in alone.items()}
    pred = predict_contended(plan, costs, alone, slow)
    low = predict_step(plan, costs, durations=alone).step_time
    high = predict_step(plan, costs, durations=slow).step_time
    assert low < pred.step_time < high
    shares = busy_shares(pred.timeline)
    for e in pred.timeline.events:
        if e.kind != "wait":
            key = (e.stage, e.kind, e.microbatch)
            assert e.duration == pytest.approx(alone[key] + shares[key] * (slow[key] - alone[key]), rel=1e-4)
    # the steady state overlaps almost fully: most actions pay most of the contended cost
    assert sum(shares.values()) / len(shares) > 0.7


def test_bad_contended_inputs_are_named():
    plan, costs = get_schedule("gpipe", 2, 2), StageCosts.uniform(2)
    alone = gpipe_costs(2, 2)
    with pytest.raises(ValueError, match="cover different actions"):
        predict_contended(plan, costs, alone, {**alone, (0, "R", 0): 1.0})
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        predict_contended(plan, costs, alone, alone, rounds=0)


def times(size: int, scale: float = 1.0, recompute: float | None = None) -> dict[str, list[float]]:
    forward = [scale * (1e-3 + 1e-4 * size)] * 4
    out = {"forward_grad": forward, "forward_nograd": forward, "backward": [2 * f for f in forward]}
    if recompute is not None:
        out["recompute"] = [recompute * f for f in forward]
    return out


def test_cost_model_pays_contention_only_with_several_stages():
    alone = CostModel.fit({1: times(1), 8: times(8)})
    both = CostModel.fit({1: times(1), 8: times(8)}, contended_by_size={1: times(1, 2.0), 8: times(8, 2.0)})
    assert both.predict([4], 4, 32).step_time == pytest.approx(alone.predict([4], 4, 32).step_time)
    assert both.predict([2, 2], 1, 8).step_time == pytest.approx(alone.predict([2, 2], 1, 8).step_time)
    assert both.predict([2, 2], 8, 64).step_time > 1.3 * alone.predict([2, 2], 8, 64).step_time


def test_recompute_times_price_the_replayed_forward():
    plain = CostModel.fit({1: times(1), 8: times(8)})
    cheap = CostModel.fit({1: times(1, recompute=0.5), 8: times(8, recompute=0.5)})
    # K=1, M=4 (except_last): three replays of a 4-layer stage at 8 samples each
    saved = 3 * 4 * 0.5 * (1e-3 + 8e-4)
    assert plain.predict([4], 4, 32).step_time - cheap.predict([4], 4, 32).step_time == pytest.approx(saved)


def test_contended_table_must_match_the_alone_one():
    fitted = CostModel.fit({1: times(1), 8: times(8)})
    with pytest.raises(ValueError, match="lacks"):
        CostModel(fitted.layers, contended={"backward": fitted.layers["backward"]})
    with pytest.raises(ValueError, match="different layer counts"):
        CostModel(fitted.layers, contended={k: v[:2] for k, v in fitted.layers.items()})
    with_recompute = CostModel.fit({1: times(1, recompute=1.0), 8: times(8, recompute=1.0)})
    with pytest.raises(ValueError, match="'recompute' is in one"):
        CostModel(with_recompute.layers, contended=fitted.layers)

"""The fixed + per-sample cost model: its fit, its checks, and the steps it predicts."""

from __future__ import annotations

import pytest

from gpipe_lab.planner.cost_model import CostModel, fit_piecewise


def times(size: int, layers: int = 4) -> dict[str, list[float]]:
    """Per-layer times that are exactly 1 ms + 0.1 ms per sample forward, twice that backward."""
    forward = [1e-3 + 1e-4 * size] * layers
    return {"forward_grad": forward, "forward_nograd": [0.5 * f for f in forward],
            "backward": [2 * f for f in forward]}


@pytest.mark.parametrize("sizes", [[4], [4, 4]])
def test_fit_needs_two_distinct_sizes(sizes: list[int]) -> None:
    with pytest.raises(ValueError, match=">= 2 micro-batch sizes"):
        CostModel.fit({s: times(s) for s in set(sizes)})


def test_single_stage_step_is_the_sum_of_its_actions() -> None:
    model = CostModel.fit({1: times(1), 8: times(8)}, action_overhead=1e-4)
    pred = model.predict([4], chunks=4, batch=32)  # micro-batches of 8; three replayed (except_last)
    f = 4 * (1e-3 + 8e-4)
    step = 1e-4 * (4 + 4 + 3) + 3 * 0.5 * f + f + 3 * f + 4 * 2 * f
    assert pred.step_time == pytest.approx(step)


def test_handover_delays_each_boundary_crossing() -> None:
    model = CostModel.fit({1: times(1), 8: times(8)})
    slow = CostModel(model.layers, handover=1e-2)
    # one micro-batch, two stages: one hop forward and one hop back
    assert slow.predict([2, 2], 1, 8).step_time - model.predict([2, 2], 1, 8).step_time == pytest.approx(2e-2)


def test_two_predictions_of_one_setting_agree() -> None:
    model = CostModel.fit({2: times(2), 16: times(16)}, 1e-4, 5e-5)
    assert model.predict([1, 3], 8, 32).step_time == model.predict([1, 3], 8, 32).step_time


def test_bad_inputs_are_named() -> None:
    model = CostModel.fit({1: times(1), 8: times(8)})
    with pytest.raises(ValueError, match="covers 3 layers"):
        model.predict([1, 2], 2, 8)
    with pytest.raises(ValueError, match="lacks"):
        CostModel({"backward": []})
    with pytest.raises(ValueError, match="unknown kind"):
        model.stage_seconds("W", [4], 1)


def test_a_fit_over_three_sizes_reproduces_each_measured_size():
    # a layer whose per-sample cost grows with the micro-batch (caches): no single line fits
    curve = {8: 0.010, 64: 0.040, 256: 0.200}
    piece = fit_piecewise(list(curve), list(curve.values()))
    assert all(piece.at(n) == pytest.approx(s) for n, s in curve.items())
    assert piece.at(32) == pytest.approx(0.010 + (0.040 - 0.010) * 24 / 56)  # between 8 and 64
    assert piece.at(512) == pytest.approx(0.200 + 256 * (0.200 - 0.040) / 192)  # the last interval extended
    assert piece.at(1) > 0
    model = CostModel.fit({n: {k: [s] for k in ("forward_grad", "forward_nograd", "backward")}
                           for n, s in curve.items()})
    for n, s in curve.items():
        assert model.stage_seconds("backward", [1], n) == [pytest.approx(s)]
    with pytest.raises(ValueError, match="2 distinct"):
        fit_piecewise([4, 4], [1.0, 2.0])

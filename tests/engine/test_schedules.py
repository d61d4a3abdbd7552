"""Schedules are data: complete, dependency-respecting, and 1F1B bounds live activations."""

from __future__ import annotations

import pytest

from gpipe_lab.pipeline import Action, analytic_bubble, get_schedule, validate_schedule


def live_peak(actions: list[Action]) -> int:
    """Largest number of micro-batches forwarded but not yet backwarded."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8, 16])
def test_one_forward_and_one_backward_per_microbatch(name, stages, microbatches):
    schedule = get_schedule(name, stages, microbatches)
    validate_schedule(schedule, microbatches)  # raises on missing/duplicate/deadlock
    assert len(schedule) == stages
    for k, actions in enumerate(schedule):
        assert sorted((a.kind, a.microbatch) for a in actions) == sorted(
            [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)])
        assert all(a.stage == k for a in actions)


@pytest.mark.parametrize("stages,microbatches", [(2, 8), (4, 8), (4, 16), (8, 32), (4, 2)])
def test_1f1b_keeps_at_most_k_minus_stage_alive(stages, microbatches):
    one_f_one_b = get_schedule("1f1b", stages, microbatches)
    fill_drain = get_schedule("gpipe", stages, microbatches)
    for k in range(stages):
        assert live_peak(one_f_one_b[k]) == min(stages - k, microbatches)
        assert live_peak(fill_drain[k]) == microbatches


def test_validate_schedule_catches_errors():
    good = get_schedule("gpipe", 2, 2)
    with pytest.raises(ValueError, match="stage 1 has no B for micro-batch 0"):
        validate_schedule([good[0], good[1][:-1]], 2)
    swapped = [list(reversed(good[0])), good[1]]
    with pytest.raises(ValueError, match="B0 before F0"):
        validate_schedule(swapped, 2)
    # stage 0 waits for B0 from stage 1, which first waits for F1 that stage 0 sends after B0
    deadlock = [[Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
                [Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1)]]
    with pytest.raises(ValueError, match="deadlock"):
        validate_schedule(deadlock, 2)


def test_unknown_schedule_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'.*gpipe"):
        get_schedule("pipedream", 2, 4)


def test_analytic_bubble():
    assert analytic_bubble(4, 4) == pytest.approx(3 / 7)
    assert analytic_bubble(1, 8) == 0.0
    assert analytic_bubble(4, 8, virtual_stages=2) == pytest.approx(3 / 19)

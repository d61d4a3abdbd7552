"""Schedules are data: every family complete and deadlock-free, the registry explicit, one walker.

Fill-drain and 1F1B bound live activations as the paper says; the split-backward
schedules (zb-h1, zb-h2, gpipe-bw) hold one W per micro-batch after its B; the
interleaved schedule places chunk s on rank s mod K. Running them is tested in
test_pipeline_equivalence.py (threads) and tests/distributed (processes).
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from gpipe_lab.pipeline import Action, analytic_bubble, get_schedule, validate_schedule
from gpipe_lab.pipeline.schedules import (
    SCHEDULES,
    dependency,
    interleaved_1f1b_schedule,
    rank_schedule,
    validate_rank_schedule,
    walk,
    weight_runs,
)


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


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "gpipe-bw"])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 16])
def test_lists_are_complete_and_valid(name, K, M):
    schedule = get_schedule(name, K, M)
    validate_schedule(schedule, M)
    for actions in schedule:
        assert Counter(a.kind for a in actions) == {"F": M, "B": M, "W": M}
        order = {(a.kind, a.microbatch): pos for pos, a in enumerate(actions)}
        assert all(order[("F", i)] < order[("B", i)] < order[("W", i)] for i in range(M))


@pytest.mark.parametrize("K,M", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_keeps_1f1b_peak_in_flight(K, M):
    def peak(schedule):
        worst = 0
        for actions in schedule:
            alive = 0
            split = {a.microbatch for a in actions if a.kind == "W"}
            for a in actions:
                if a.kind == "F":
                    alive += 1
                    worst = max(worst, alive)
                elif a.kind == "W" or (a.kind == "B" and a.microbatch not in split):
                    alive -= 1
        return worst
    assert peak(get_schedule("zb-h1", K, M)) == peak(get_schedule("1f1b", K, M)) == K


def test_weight_runs_group_consecutive_w_of_one_stage():
    actions = [Action(0, "B", 1), Action(0, "W", 1), Action(0, "W", 0), Action(1, "W", 0),
               Action(0, "F", 2), Action(0, "B", 2), Action(0, "W", 2)]
    assert weight_runs(actions) == {0: {1: (1, 0), 0: (1, 0), 2: (2,)}, 1: {0: (0,)}}
    bw = get_schedule("gpipe-bw", 3, 4)
    assert all(weight_runs(stage)[k] == {i: (3, 2, 1, 0) for i in range(4)} for k, stage in enumerate(bw))


def test_every_built_in_schedule_is_listed_without_importing_its_module():
    """The registry is explicit: a fresh process sees interleaved-1f1b through the options alone."""
    code = ("from gpipe_lab.pipeline.options import PipelineOptions; "
            "PipelineOptions(schedule='interleaved-1f1b', virtual_stages=2).check(); "
            "from gpipe_lab.pipeline.schedules import SCHEDULES; print(sorted(SCHEDULES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(sorted(["gpipe", "1f1b", "interleaved-1f1b", "gpipe-bw", "zb-h1", "zb-h2"]))
    assert set(SCHEDULES) >= {"gpipe", "1f1b", "interleaved-1f1b", "gpipe-bw", "zb-h1", "zb-h2"}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("K,M,v", [(2, 4, 2), (4, 8, 2), (3, 6, 3), (2, 2, 4)])
def test_virtual_stage_forms_place_chunk_s_on_rank_s_mod_k(name, K, M, v):
    ranks = get_schedule(name, K, M, v)
    validate_schedule(ranks, M, v)
    assert all(a.stage % K == k for k, actions in enumerate(ranks) for a in actions)
    assert sum(len(actions) for actions in ranks) == 2 * K * v * M


def test_interleaved_warm_up_and_rank_schedule_alias():
    K, M, v = 4, 8, 2
    ranks = interleaved_1f1b_schedule(K, M, v)
    validate_rank_schedule(ranks, M, v)
    first_backward = next(i for i, a in enumerate(ranks[0]) if a.kind == "B")
    assert first_backward == 2 * (K - 1) + (v - 1) * K + 1  # warm-up forwards, then 1F before 1B
    assert rank_schedule("1f1b", 3, 5) == get_schedule("1f1b", 3, 5) == get_schedule("interleaved-1f1b", 3, 5)
    with pytest.raises(ValueError, match="no form with virtual_stages=2"):
        get_schedule("zb-h1", 2, 4, 2)


def test_walk_orders_every_action_after_what_it_depends_on():
    for name in SCHEDULES:
        schedule = get_schedule(name, 3, 5)
        order = walk(schedule)
        assert sorted(map(str, (a for _, a in order))) == sorted(str(a) for s in schedule for a in s)
        position = {a: i for i, (_, a) in enumerate(order)}
        for a in position:
            dep = dependency(a, 3)
            assert dep is None or position[dep] < position[a]
        for k, actions in enumerate(schedule):  # each rank's own order is kept
            assert [a for r, a in order if r == k] == actions


def test_the_validator_and_the_simulator_name_the_same_deadlock():
    from gpipe_lab.planner import StageCosts, simulate

    # stage 0 waits for B0 from stage 1, which first waits for F1 that stage 0 sends after B0
    deadlock = [[Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
                [Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1)]]
    with pytest.raises(ValueError, match=r"deadlocks; stages wait at \['B0@0', 'F1@1'\]") as walked:
        validate_schedule(deadlock, 2)
    with pytest.raises(ValueError, match="deadlocks") as simulated:
        simulate(deadlock, StageCosts.uniform(2))
    assert str(walked.value) in str(simulated.value)

"""The simulator: analytic bubbles exactly, zero-bubble's gain, and a measured step replayed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import Action, Event, Timeline, analytic_bubble, get_schedule
from gpipe_lab.planner import StageCosts, costs_from_timeline, durations_from_timeline, predict_step, simulate


def idle(prediction) -> float:
    t = prediction.timeline
    return t.num_stages * t.wall - sum(t.busy())


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 4, 7, 16])
def test_uniform_costs_reproduce_the_analytic_bubble(name, K, M):
    costs = StageCosts.uniform(K, forward=1.0, backward_input=1.5, backward_weight=0.5)
    pred = predict_step(get_schedule(name, K, M), costs)
    assert pred.bubble == pytest.approx(analytic_bubble(K, M), abs=1e-12)
    assert pred.step_time == pytest.approx((M + K - 1) * 3.0)


@pytest.mark.parametrize("K,M", [(2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_has_at_most_40_percent_of_1f1b_bubble(K, M):
    costs = StageCosts.uniform(K, 1.0, 1.0, 1.0)
    zb = predict_step(get_schedule("zb-h1", K, M), costs)
    one = predict_step(get_schedule("1f1b", K, M), costs)
    assert idle(zb) <= 0.4 * idle(one)  # (K-1)(F+B-W) against (K-1)(F+B+W): 1/3
    assert zb.step_time == pytest.approx(3 * M + K - 1)
    assert predict_step(get_schedule("zb-h2", K, M), costs).step_time <= zb.step_time


def test_transfer_recompute_and_waits():
    schedule = get_schedule("gpipe", 2, 1)
    costs = StageCosts([1.0, 2.0], [1.0, 1.0], [0.5, 0.5], recompute=[0.25, 0.25], transfer=[0.1])
    tl = simulate(schedule, costs, checkpointed={0})
    kinds = [(e.stage, e.kind, e.start, e.end) for e in tl.events]
    assert (1, "wait", 0.0, pytest.approx(1.1)) in kinds
    # the recompute runs before the wait for the gradient, as the engine does:
    # stage 1: F 1.1-3.1, R 3.1-3.35, B (1.5) 3.35-4.85; stage 0: F 0-1, R 1-1.25, wait, B 4.95-6.45
    assert tl.wall == pytest.approx(6.45)
    assert [e.kind for e in tl.events if e.stage == 0] == ["F", "R", "wait", "B"]


def test_deadlock_and_bad_costs_are_named():
    bad = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ValueError, match="deadlocks.*B0@0"):
        simulate(bad, StageCosts.uniform(2))
    with pytest.raises(ValueError, match="costs are for 3 stages"):
        simulate(get_schedule("gpipe", 2, 2), StageCosts.uniform(3))
    with pytest.raises(ValueError, match="negative"):
        StageCosts([1.0], [-1.0], [0.0])


def test_costs_from_timeline_reads_medians_and_hops():
    events = [Event(0, "F", 0, 0.0, 1.0), Event(1, "wait", 0, 0.0, 1.2), Event(1, "F", 0, 1.2, 3.2),
              Event(1, "B", 0, 3.2, 4.2), Event(1, "W", 0, 4.2, 5.2), Event(0, "B", 0, 4.4, 4.9),
              Event(0, "W", 0, 4.9, 5.9)]
    costs = costs_from_timeline(Timeline(2, 0.0, 5.9, events))
    assert list(costs.forward) == [1.0, 2.0]
    assert list(costs.backward_input) == pytest.approx([0.5, 1.0])
    assert list(costs.backward_weight) == pytest.approx([1.0, 1.0])
    assert list(costs.transfer) == pytest.approx([0.2])


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def _compute_events(timeline: Timeline, stage: int) -> list[Event]:
    return sorted((e for e in timeline.events if e.stage == stage and e.kind in "FBW"),
                  key=lambda e: e.start)


def _dependency(e: Event, K: int) -> tuple[int, str, int] | None:
    if e.kind == "F" and e.stage > 0:
        return (e.stage - 1, "F", e.microbatch)
    if e.kind == "B" and e.stage < K - 1:
        return (e.stage + 1, "B", e.microbatch)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "gpipe-bw"])
def test_replaying_a_measured_step_starts_every_action_no_later(schedule, checkpoint):
    """K=2 CPU stages, real steps: fed each action's measured duration, the simulator is that step
    without hand-over delays, so every action starts no later than the engine started it, each stage
    is exactly as busy, and both timelines run the schedule's lists with every dependency respected.

    No wall-clock threshold: a dependency the engine skipped or the simulator invents breaks it on
    any machine, however loaded. (How close the predicted time comes is benchmarks/bench_schedules.py.)
    """
    torch.manual_seed(0)
    K, M = 2, 4
    model = nn.Sequential(*[_block() for _ in range(4)])
    pipe = GPipe(model, balance=[2, 2], chunks=M, checkpoint=checkpoint, schedule=schedule)
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    actions = get_schedule(schedule, K, M)
    ratios = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        pipe.train_step(x, y, F.mse_loss)
        measured = pipe.timeline
        replay = simulate(actions, StageCosts.uniform(K, 0.0, 0.0, 0.0),
                          checkpointed=range(M) if checkpoint == "always" else (),
                          durations=durations_from_timeline(measured))
        for timeline in (measured, replay):
            ends = {(e.stage, e.kind, e.microbatch): e.end for e in timeline.events if e.kind != "wait"}
            for k in range(K):
                ran = _compute_events(timeline, k)
                assert [(e.kind, e.microbatch) for e in ran] == [(a.kind, a.microbatch) for a in actions[k]]
                for before, after in zip(ran, ran[1:]):
                    assert after.start >= before.end - 1e-9
                for e in ran:
                    dep = _dependency(e, K)
                    assert dep is None or e.start >= ends[dep] - 1e-9, f"{e} started before {dep} ended"
            replayed = sum(1 for e in timeline.events if e.kind == "R")
            assert replayed == (K * M if checkpoint == "always" else 0)
        starts = {(e.stage, e.kind, e.microbatch): e.start for e in replay.events if e.kind != "wait"}
        for e in measured.events:
            if e.kind != "wait":
                assert starts[(e.stage, e.kind, e.microbatch)] <= e.start - measured.start + 1e-6, e
        assert replay.busy() == pytest.approx(measured.busy(), rel=1e-9)
        assert replay.wall <= measured.wall + 1e-6
        ratios.append(replay.wall / measured.wall)
    print(f"{schedule}/{checkpoint}: replayed / measured step time {[round(r, 3) for r in ratios]}")


def test_interleaved_virtual_stages_follow_the_interleaved_bubble_and_run_on_their_ranks() -> None:
    # K=2 devices, v=2 stages each (S=4), M=4; a stage's F costs 1, its B 2 (half a device's layers):
    # step = M·v·(f+b) + (K-1)·(f+b) = 24 + 3 (Megatron's bubble (K-1)/(v·M) of the ideal step)
    from gpipe_lab.planner.simulator import simulate_stages

    plan = get_schedule("interleaved-1f1b", 2, 4, 2)
    costs = StageCosts.uniform(4, forward=1, backward_input=2, backward_weight=0)
    pred = predict_step(plan, costs)
    assert pred.step_time == 27 and pred.timeline.num_stages == 2
    assert abs(pred.bubble - 3 / 27) < 1e-12
    one = predict_step(get_schedule("1f1b", 2, 4), StageCosts.uniform(2, forward=2, backward_input=4,
                                                                       backward_weight=0))
    assert one.step_time == 30  # the same work without virtual stages: a larger bubble
    stages = simulate_stages(plan, costs)
    assert stages.num_stages == 4 and {e.stage for e in stages.events} == {0, 1, 2, 3}
    for k in (0, 1):  # each rank runs its two stages' actions, one at a time
        mine = sorted((e for e in stages.events if e.stage % 2 == k and e.kind != "wait"), key=lambda e: e.start)
        assert sum(e.duration for e in mine) == 24
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
    with pytest.raises(ValueError, match="costs are for 2 stages but the schedule has 4"):
        predict_step(plan, StageCosts.uniform(2))

"""Measured trials (``planner.trials``): the fastest measured of the fastest predicted plans that fit is
chosen, a plan measured over the budget never is, and ``measure_plan`` times real GPipe steps."""

from __future__ import annotations

import pytest

from gpipe_lab.pipeline import PipelineOptions
from gpipe_lab.planner.plan_types import Candidate, PlanResult, Scored
from gpipe_lab.planner.trials import measure_plan, refine_by_trials
from gpipe_lab.planner.workload import WorkloadSpec

SPEC = WorkloadSpec("tiny", "transformer_tiny", {"num_layers": 2, "d_model": 16, "ffn_dim": 32, "num_heads": 2,
                                                 "vocab_size": 32, "seq_len": 4}, 8)
BUDGET = 1000


def plan(m: int, predicted: float, peak: float = 500.0, reason: str = "") -> Scored:
    options = PipelineOptions(partitions=2, balance=[2, 2], chunks=m, schedule="gpipe", checkpoint="never")
    return Scored(Candidate(options), [peak, peak], predicted, 0.1, reason)


def result(*runners: Scored) -> PlanResult:
    chosen = plan(1, 0.010, reason="chosen: fastest predicted step that fits")
    return PlanResult(chosen, list(runners), BUDGET, 8, 2, 10, 5, 5, 0.01)


def fake(measured: dict[int, tuple[float, float]], calls: list[int] | None = None):
    """A measure that reports, per M, (step seconds, bytes per stage)."""
    def measure(spec, c, steps, bytes_per_param):
        if calls is not None:
            calls.append(c.options.chunks)
        seconds, stage = measured[c.options.chunks]
        return [seconds] * steps, [stage, stage / 2]
    return measure


def test_the_fastest_measured_plan_wins_and_each_keeps_its_prediction_beside_its_measurement() -> None:
    calls: list[int] = []
    over = plan(8, 0.009, peak=2000, reason="over memory on stage 0")  # never trialled: predicted over
    got = refine_by_trials(result(plan(2, 0.011, reason="slower by 10%"), plan(4, 0.012), plan(16, 0.013), over),
                           SPEC, trials=3, rounds=2,
                           measure=fake({1: (0.020, 400), 2: (0.015, 400), 4: (0.018, 400)}, calls))
    assert calls == [1, 2, 4, 1, 2, 4]  # three plans, rounds interleaved
    assert got.chosen.candidate.options.chunks == 2 and got.chosen.measured_step == 0.015
    assert got.chosen.step_time == 0.011 and got.chosen.reason == "chosen: fastest measured of 3 trials"
    assert got.trials == 3 and got.chosen.measured_stage_bytes == [400, 200]
    reasons = {r.candidate.options.chunks: r.reason for r in got.runners_up}
    assert reasons[1] == "measured slower by 33.3% in its trial"
    assert reasons[4] == "measured slower by 20.0% in its trial"
    assert reasons[16] == "not trialled; predicted against the first choice: "  # a fitting plan past the trials
    assert reasons[8] == "over memory on stage 0"  # never a candidate: its reason stands
    assert got.to_dict()["chosen"]["measured_step_s"] == 0.015 and got.to_dict()["trials"] == 3


def test_a_plan_measured_over_the_budget_is_not_chosen() -> None:
    got = refine_by_trials(result(plan(2, 0.011)), SPEC, trials=2,
                           measure=fake({1: (0.020, 400), 2: (0.010, 1500)}))
    assert got.chosen.candidate.options.chunks == 1
    over = next(r for r in got.runners_up if r.candidate.options.chunks == 2)
    assert over.reason == "over memory in its trial on stage 0: 1.5 KiB > 1000 B"


def test_when_every_trial_is_over_the_budget_the_prediction_stands_with_a_note() -> None:
    got = refine_by_trials(result(plan(2, 0.011)), SPEC, trials=2,
                           measure=fake({1: (0.020, 1500), 2: (0.010, 1500)}))
    assert got.chosen.candidate.options.chunks == 1 and "every trial measured over the budget" in got.chosen.reason
    assert any("measured over" in note for note in got.notes)


def test_no_trials_leaves_the_result_and_bad_counts_are_refused() -> None:
    before = result(plan(2, 0.011))
    assert refine_by_trials(before, SPEC, trials=0, measure=fake({})) is before
    with pytest.raises(ValueError, match="trials must be >= 0 and rounds >= 1, got trials=-1"):
        refine_by_trials(before, SPEC, trials=-1)
    with pytest.raises(ValueError, match="rounds=0"):
        refine_by_trials(before, SPEC, trials=1, rounds=0)


def test_measure_plan_times_real_steps_and_counts_memory_per_stage() -> None:
    model = SPEC.model()
    cut = len(model) // 2
    balance = [cut, len(model) - cut]
    plan = Candidate(PipelineOptions(partitions=2, balance=balance, chunks=2, schedule="1f1b", checkpoint="except_last"))
    seconds, stage_bytes = measure_plan(SPEC, plan, 2, bytes_per_param=16)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    params = [sum(p.numel() for p in part.parameters()) for part in (model[:cut], model[cut:])]
    assert len(stage_bytes) == 2
    assert all(b > 16 * p for b, p in zip(stage_bytes, params))  # parameter state plus saved activations


def test_a_plan_is_the_pipeline_options_that_run_it() -> None:
    c = plan(4, 0.01).candidate
    run = PipelineOptions(partitions=3, chunks=8, seed=7, timeout=9.0, deferred_batch_norm=True)
    applied = c.applied_to(run)
    assert applied == c.options.replace(seed=7, timeout=9.0, deferred_batch_norm=True)  # the run's other options kept
    assert applied.chunks == 4 and applied.balance == [2, 2] and run.chunks == 8  # the run's options untouched
    same = plan(4, 0.02).candidate
    assert same == c and {c: 1}[same] == 1  # a plan is a dict key
    assert c.describe() == "K=2 M=4 balance=[2, 2] schedule=gpipe checkpoint=never"

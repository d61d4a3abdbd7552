"""Trainability: the divergence rule (spike apart), the reproduced / not rule on synthetic numbers, the selection's
choice, the clip's binding count, a shallow run that learns, and the report's plan read from the selection JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from experiments.trainability_lib import Run, Setting, Task, facts, train, verdict

from experiments import trainability, trainability_lib, trainability_search


def test_divergence_is_non_finite_or_ending_above_the_start_and_a_recovered_spike_is_not() -> None:
    spiked = facts([4.0, 3.0, 5.0, 1.0] + [1.0] * 10, nonfinite=False, bleu=90.0)
    assert spiked["transient_spike"] and spiked["spike"] == pytest.approx((5.0 - 3.0) / 4.0)
    assert not spiked["diverged"] and spiked["learns"]
    above = facts([4.0] + [4.1] * 12, nonfinite=False, bleu=90.0)
    assert above["diverged"] and not above["learns"] and not above["transient_spike"]
    stopped = facts([4.0, 3.0], nonfinite=True, bleu=0.0)
    assert stopped["diverged"] and not stopped["learns"]
    noise_near_zero = facts([4.0, 0.01, 0.05, 0.02] + [0.01] * 10, nonfinite=False, bleu=90.0)
    assert not noise_near_zero["transient_spike"] and noise_near_zero["spike"] == pytest.approx(0.01)
    below_bar = facts([4.0] + [1.0] * 12, nonfinite=False, bleu=79.9)
    assert not below_bar["diverged"] and not below_bar["learns"]


def runs(learning: int, total: int = 5) -> list[dict]:
    return [{"learns": i < learning} for i in range(total)]


def test_the_verdict_needs_learning_shallow_baselines_a_failing_deep_baseline_and_learning_fixes() -> None:
    outcome, reason = verdict(runs(10, 10), runs(2), runs(4))
    assert outcome == "reproduced" and "fails in 3 of 5" in reason and "4 of 5 learn" in reason
    assert verdict(runs(9, 10), runs(0), runs(5))[0] == "not reproduced"  # one shallow run misses the bar
    assert verdict(runs(10, 10), runs(3), runs(5))[0] == "not reproduced"  # the deep baseline mostly learns
    outcome, reason = verdict(runs(10, 10), runs(0), runs(3))
    assert outcome == "not reproduced" and "3 of 5 learn (missed)" in reason
    with pytest.raises(ValueError, match="one group is empty"):
        verdict([], runs(0), runs(5))


def test_the_selection_takes_the_best_passing_setting_and_breaks_ties_to_the_smaller_lr() -> None:
    def row(lr: float, warmup: int, *bleus: float) -> dict:
        return {"lr": lr, "warmup": warmup, "runs": [{"bleu": b, "learns": b >= 80} for b in bleus]}

    best_mean_fails_a_seed = row(0.01, 0, 99.0, 79.0)
    rows = [best_mean_fails_a_seed, row(0.003, 0, 85.0, 85.0), row(0.001, 50, 85.02, 84.98), row(0.001, 0, 81, 81)]
    assert trainability_search.choose(rows) is rows[2]
    nothing = [row(0.01, 0, 10.0), row(0.003, 0, 30.0)]
    assert trainability_search.choose(nothing) is nothing[1]


def test_a_one_layer_model_learns_and_the_clip_binding_is_counted() -> None:
    task = Task(d_model=32, ffn_dim=64, num_train=256, num_val=16)
    base = train(Run(1, False, "none", 0, Setting(0.01, 0, 40), task))
    assert not base["diverged"] and base["final_over_start"] < 0.6 and base["steps_run"] == 40
    tight = train(Run(1, False, "logit clip", 0, Setting(0.01, 0, 5), task, clip=1e-3))
    assert tight["clip_steps"] == 5 and tight["clip_share"] > 0.99
    loose = train(Run(1, False, "logit clip", 0, Setting(0.01, 0, 5), task, clip=1e6))
    assert loose["clip_steps"] == 0 and loose["clip_share"] == 0.0


def test_the_report_trains_its_plan_at_the_selected_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Run] = []

    def fake(run: Run) -> dict:
        calls.append(run)
        learns = run.layers == 1 or run.variant == "both"
        return {**trainability_lib.asdict(run), **facts([4.0] + [1.0] * 10, False, 90.0 if learns else 5.0),
                "exact": 0.5, "steps_run": 11, "clip_steps": 0, "clip_share": 0.0, "params": 10, "seconds": 0.1,
                "losses": [4.0] + [1.0] * 10}

    monkeypatch.setattr(trainability_lib, "train", fake)
    argv = [trainability.__file__, "--tiny", "--out", str(tmp_path), "experiment.seeds=[3,4]"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(ValueError, match="does not exist"):
        trainability.chosen_setting(tmp_path / "none.json", tiny=False, lr=0.1, steps=3)
    (tmp_path / "trainability_search.json").write_text(json.dumps(
        {"chosen": {"lr": 0.02, "warmup": 7, "steps": 9}, "selection_seeds": [0], "meta": {"commit": "abc"}}))
    trainability.main()
    assert {c.setting for c in calls} == {Setting(0.02, 7, 9)} and {c.seed for c in calls} == {3, 4}
    groups = [(c.pre_norm, c.variant, c.layers) for c in calls[::2]]
    assert groups == [(False, "none", 1), (False, "none", 2), (False, "ffn init scaling", 2),
                      (False, "logit clip", 2), (False, "both", 2), (True, "none", 2)]
    text = (tmp_path / "trainability.md").read_text()
    assert "**Not reproduced**" in text and "(a) shallow baselines learn in 2 of 4 (missed)" in text
    assert "selection seeds [0]" in text and "lr 0.02 with 7 linear warm-up steps, 9 steps" in text

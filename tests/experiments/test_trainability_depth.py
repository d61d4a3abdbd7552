"""Trainability about depth: a run's facts (divergence from step 1, learns), the depth verdict, and the
search's order (the deepest baseline first, stop at the first failed condition) and kept rows."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from experiments.nmt_lib import RunResult
from experiments.trainability_lib import depth_verdict, facts

from experiments import trainability_search as search
from gpipe_lab.bench import Progress


def run(losses: list[float]) -> RunResult:
    return RunResult(losses=losses, grad_norms=[1.0] * len(losses), val_nll=1.0, bleu=0.0)


def test_a_spike_at_step_one_is_a_divergence_and_a_flat_run_does_not_learn() -> None:
    spiked = facts(run([4.0, 6.5, 3.0, 2.0]), seed=0)
    assert spiked["diverged"] and spiked["early_spike"] == pytest.approx(6.5 / 4.0) and not spiked["learns"]
    flat = facts(run([4.0] + [3.9] * 20), seed=1)
    assert not flat["diverged"] and flat["final_over_start"] == pytest.approx(3.9 / 4.0) and not flat["learns"]
    learning = facts(run([4.0] + [2.0] * 20), seed=2)
    assert learning["learns"] and learning["final_over_start"] == pytest.approx(0.5)


def fact(diverged: bool, learns: bool = False) -> dict:
    return {"diverged": diverged, "learns": learns}


def test_the_depth_verdict_needs_deep_divergence_quiet_shallow_depths_and_learning_fixes() -> None:
    deep = [fact(True), fact(True), fact(False)]
    quiet = [fact(False)] * 3
    learning = [fact(False, True)] * 3
    ok, words = depth_verdict({24: deep, 1: quiet, 2: quiet}, learning)
    assert ok and "L=24 diverged in 2 of 3" in words and "3 of 3 learn" in words
    assert not depth_verdict({24: deep, 1: [fact(True), *quiet[1:]], 2: quiet}, learning)[0]
    ok, words = depth_verdict({24: deep, 1: quiet, 2: quiet}, [*learning[:2], fact(False)])
    assert not ok and "2 of 3 learn" in words
    assert not depth_verdict({24: [fact(True)] + quiet[:2], 1: quiet, 2: quiet}, learning)[0]
    assert not depth_verdict({24: deep, 1: quiet, 2: quiet}, None)[0]


def fake_training(calls: list) -> object:
    """Deep baselines (L >= 12) spike at step 1; every other run learns."""

    def train(steps: int, num_layers: int, **kwargs: object) -> RunResult:
        calls.append((num_layers, bool(kwargs.get("ffn_init_scaling"))))
        deep = num_layers >= 12 and not kwargs.get("ffn_init_scaling")
        return run([4.0, 9.0, 5.0] if deep else [4.0] + [2.0] * steps)

    return train


def test_the_search_runs_deepest_first_and_the_profile_only_after_the_fixes_learn(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(search, "train_translation", fake_training(calls))
    setting = {**search.TINY_GRID[0], "steps": 12}
    row = search.try_setting(setting, (1, 2, 6, 12, 24), (0, 1, 2), 100, Progress(99, "t", io.StringIO()))
    assert row["effect"] and [c[0] for c in calls[::3]] == [24, 1, 2, 24, 6, 12] and calls[9][1]
    assert sorted(row["baseline"]) == ["1", "12", "2", "24", "6"] and len(row["both_fixes_deepest"]) == 3
    calls.clear()
    row = search.try_setting(setting, (1, 2, 6), (0,), 100, Progress(9, "t", io.StringIO()))
    assert not row["effect"] and calls == [(6, False)] and "L=6 diverged in 0 of 1" in row["reason"]


def test_first_keeps_only_rows_that_match_the_grid(tmp_path: Path) -> None:
    path = tmp_path / "trainability_search.json"
    with pytest.raises(ValueError, match="--first 1 needs"):
        search.kept_rows(path, 1, search.GRID)
    path.write_text(json.dumps({"tried": [{"setting": {"lr": 9.0}}]}))
    with pytest.raises(ValueError, match=r"does not hold GRID\[:1\]"):
        search.kept_rows(path, 1, search.GRID)
    path.write_text(json.dumps({"tried": [{"setting": search.GRID[0], "effect": False}]}))
    assert search.kept_rows(path, 1, search.GRID)[0]["setting"] == search.GRID[0]
    assert search.kept_rows(path, 0, search.GRID) == []


def test_the_depth_comparison_says_when_shallow_models_diverge_as_often() -> None:
    def row(deep: int, one: int, two: int) -> dict:
        return {"baseline": {"24": [fact(i < deep) for i in range(3)], "1": [fact(i < one) for i in range(3)],
                             "2": [fact(i < two) for i in range(3)]}}

    words = search.depth_comparison([row(3, 3, 3), {"baseline": {"24": [fact(False)] * 3}}], (1, 2, 24))
    assert "(#0: L=24 3, L=1 3, L=2 3 diverged runs)" in words and "1 of 1 setting(s): in this grid" in words
    words = search.depth_comparison([row(3, 3, 3), row(2, 0, 1)], (1, 2, 24))
    assert "in 1 of 2 setting(s)." in words and "not with depth" not in words
    assert "in none of the settings" in search.depth_comparison([{"baseline": {"24": [fact(False)]}}], (1, 2, 24))

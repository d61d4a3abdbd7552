"""``python -m experiments.plan_check --tiny`` writes its table, and its verdicts follow from its numbers."""

from __future__ import annotations

import json
import sys

from experiments import plan_check
from helpers.fake_timing import use_fake_timing


def test_plan_check_tiny_writes_its_table(monkeypatch, tmp_path) -> None:
    use_fake_timing(monkeypatch, tmp_path)  # the profile's timing is not what this checks; the grid is run
    monkeypatch.setattr(sys, "argv", ["plan_check", "--tiny", "--out", str(tmp_path / "out")])
    plan_check.main()
    md = (tmp_path / "out" / "plan_check.md").read_text()
    data = json.loads((tmp_path / "out" / "plan_check.json").read_text())
    rows = data["rows"]
    assert [(r["workload"], r["budget"].split(",")[0]) for r in rows] == [
        ("transformer", "loose"), ("transformer", "tight"), ("amoebanet", "loose"), ("amoebanet", "tight"),
        ("transformer (emulated)", "loose"), ("amoebanet (emulated)", "loose")]
    emulated = rows[4:]
    assert all(not r["memory_measured"] and r["chosen_peak_bytes"] is None for r in emulated)
    ks = {int(g["plan"].split()[0][2:]) for g in data["grids"]["transformer (emulated)"]}
    assert ks == {1, 2, 3}  # the tiny run's emulated devices: K up to 3
    for r in emulated:  # judged on speed alone: the fastest finalist, every plan fitting
        grid = data["grids"][r["workload"]]
        assert r["best_step_s"] == min(g["step_s"] for g in grid if g["finalist"])
        assert r["ratio"] == r["best_step_s"] / r["chosen_step_s"] and r["plans_fitting"] == len(grid)
        line = next(x for x in md.splitlines() if x.startswith(f"| {r['workload']} | "))
        assert line.endswith("| not measured (emulated) | "
                             f"{'yes' if r['ratio'] >= 0.9 else 'no'}; {'yes' if r['trial_ratio'] >= 0.9 else 'no'}"
                             " | n/a |")
    for r in rows[:4]:
        grid = data["grids"][r["workload"]]
        assert r["memory_measured"]
        fitting = [g for g in grid if max(g["stage_bytes"]) <= r["budget_bytes"]]
        assert min(g["step_s"] for g in fitting) == r["best_step_s"] and r["plans_fitting"] == len(fitting)
        assert r["ratio"] == r["best_step_s"] / r["chosen_step_s"]
        assert r["trial_ratio"] == r["best_step_s"] / r["trial_chosen_step_s"]
        trialled = {t["K"]: t for t in r["trialled"]}  # each trialled plan kept its measured step
        assert r["trials"] == len(r["trialled"]) >= 1 and all(t["measured_step_s"] > 0 for t in r["trialled"])
        assert trialled and any(r["trial_chosen"].startswith(f"K={k} ") for k in trialled)
        predicted = sorted((g for g in grid if max(g["predicted_stage_bytes"]) <= r["budget_bytes"]),
                           key=lambda g: g["predicted_step_s"])  # the rank is the best plan's place here
        if r["best_predicted_rank"] is not None:
            assert predicted[r["best_predicted_rank"] - 1]["plan"] == r["best"]
            assert r["plans_predicted_to_fit"] == len(predicted)
        assert r["budget_bytes"] <= rows[0 if r["workload"] == "transformer" else 2]["budget_bytes"]
        line = next(x for x in md.splitlines() if x.startswith(f"| {r['workload']} | {r['budget']} "))
        yes = {True: "yes", False: "no"}
        assert line.endswith(f"| {yes[r['ratio'] >= 0.9]}; {yes[r['trial_ratio'] >= 0.9]} | "
                             f"{yes[r['chosen_peak_bytes'] <= r['budget_bytes']]}; "
                             f"{yes[r['trial_chosen_peak_bytes'] <= r['budget_bytes']]} |")
    for key, what in (("trial_ratio", "plan=auto (its default trials)"),
                      ("ratio", "the choice by prediction alone (trials=0)")):
        close = sum(r[key] >= 0.9 for r in rows)  # every row, emulated ones included
        said = next(x for x in md.splitlines() if x.startswith(f"Finding for {what} "))
        assert f"within 10% of the best measured plan in {close} of 6 rows" in said
        assert "within the budget in " in said and " of the 4 rows on real stages" in said

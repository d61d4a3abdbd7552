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
    assert [(r["workload"], r["budget"]) for r in rows] == [
        ("transformer", "loose"), ("transformer", "tight"), ("amoebanet", "loose"), ("amoebanet", "tight")]
    for r in rows:
        grid = data["grids"][r["workload"]]
        fitting = [g for g in grid if max(g["stage_bytes"]) <= r["budget_bytes"]]
        assert min(g["step_s"] for g in fitting) == r["best_step_s"] and r["plans_fitting"] == len(fitting)
        assert r["ratio"] == r["best_step_s"] / r["chosen_step_s"]
        assert r["budget_bytes"] <= rows[0 if r["workload"] == "transformer" else 2]["budget_bytes"]
        line = next(x for x in md.splitlines() if x.startswith(f"| {r['workload']} | {r['budget']} "))
        assert line.endswith(f"| {'yes' if r['ratio'] >= 0.9 else 'no'} | "
                             f"{'yes' if r['chosen_peak_bytes'] <= r['budget_bytes'] else 'no'} |")
    close = sum(r["ratio"] >= 0.9 for r in rows)
    assert f"within 10% of the best measured plan in {close} of 4 rows" in md

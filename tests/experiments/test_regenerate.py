"""``python -m experiments.regenerate``: every results job in order at one clean commit, recorded, resumable."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from experiments import regenerate


def test_list_names_every_job_with_its_commands(capsys: pytest.CaptureFixture) -> None:
    assert regenerate.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == list(regenerate.JOBS)
    assert "trainability: python -m experiments.trainability_search --out results; then python -m " \
           "experiments.trainability --out results" in out


def test_unknown_jobs_and_a_dirty_tree_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    assert regenerate.main(["--only", "table9"], tmp_path / "r.json") == 2
    assert "unknown job(s) ['table9']; allowed: ['table1_capacity'" in capsys.readouterr().err
    monkeypatch.setattr(regenerate, "git_commit", lambda: "abc+dirty")
    assert regenerate.main(["--only", "table1_capacity"], tmp_path / "r.json") == 2
    assert "uncommitted changes to source files (anything but results/, *.md and the tests; commit abc+dirty)" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_jobs_run_in_order_are_recorded_and_resume_skips_what_is_done(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    py = [sys.executable, "-c"]
    monkeypatch.setattr(regenerate, "JOBS", {
        "good": [py + [f"open({str(marks)!r}, 'a').write('good ')"]],
        "bad": [py + ["import sys; sys.exit(3)"], py + [f"open({str(marks)!r}, 'a').write('never ')"]],
        "after": [py + [f"open({str(marks)!r}, 'a').write('after ')"]],
    })
    monkeypatch.setattr(regenerate, "git_commit", lambda: "c0ffee")
    path = tmp_path / "regeneration.json"
    assert regenerate.main([], path) == 1  # a job failed; the others still ran
    assert marks.read_text() == "good after "
    records = {r["job"]: r for r in json.loads(path.read_text())}
    assert [records[n]["exit_status"] for n in ("good", "bad", "after")] == [0, 3, 0]
    assert all(r["commit"] == "c0ffee" and r["seconds"] >= 0 and len(r["load_before"]) in (0, 3)
               for r in records.values())
    assert all(r["cpu"] and r["cores"] == os.cpu_count() and r["torch"] == torch.__version__ for r in records.values())
    assert records["bad"]["commands"][0] == "python -c import sys; sys.exit(3)"
    assert regenerate.main(["--resume"], path) == 1  # only the failed job runs again
    assert marks.read_text() == "good after "
    assert len(json.loads(path.read_text())) == 3  # one record per job, the latest
    monkeypatch.setattr(regenerate, "git_commit", lambda: "beef00")  # another commit: nothing is done
    assert regenerate.main(["--resume", "--only", "good"], path) == 0
    assert marks.read_text() == "good after good "


def test_a_jobs_sweep_folders_are_emptied_before_it_runs(tmp_path: Path) -> None:
    stale = tmp_path / "logs" / "sweep" / "7"
    stale.mkdir(parents=True)
    (stale / "summary.json").write_text("{}")
    kept = tmp_path / "logs" / "other"
    kept.mkdir()
    command = [sys.executable, "-c", "import sys; sys.exit(0)", "hydra.sweep.dir=logs/sweep"]
    record = regenerate.run_job("sweeps", [command], root=tmp_path)
    assert record["exit_status"] == 0 and not (tmp_path / "logs" / "sweep").exists() and kept.exists()


def test_the_sweeps_job_measures_what_micro_batching_costs() -> None:
    commands = [regenerate.shown(c) for c in regenerate.JOBS["sweeps"]]
    assert sum("pipeline.threads_per_stage=1" in c and "pipeline.checkpoint=never,except_last" in c
               for c in commands) == 2
    assert commands[-1] == ("python -m experiments.microbatch_cost --from-multirun logs/table2_mb_cost "
                            "logs/table2_mb_cost_tf --out results/sweeps")

"""gpipe-train end to end in subprocesses: the default app with small overrides (wandb
offline, read back from the .wandb file) and a 2x2 multirun with its sweep summary; a bad
override refused before training (in this process)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from gpipe_lab.app.wandb_reader import find_run_files, read_run
from helpers.app import cli_here, gpipe_train

SMALL = ["data.num_train=256", "data.num_val=64", "trainer.max_steps=6", "trainer.log_every_n_steps=2",
         "data.batch_size=16", "trainer.enable_checkpointing=false"]


def warnings_shown(proc: subprocess.CompletedProcess) -> list[str]:
    """Lines of a run's output that are Python warnings (``file.py:N: message``) or wandb warnings."""
    return [line for line in (proc.stdout + proc.stderr).splitlines()
            if re.search(r"\.py:\d+: |Warning\b|WARNING", line)]


def test_default_app_logs_everything_to_offline_wandb(tmp_path: Path) -> None:
    proc = gpipe_train([*SMALL, "callbacks.timeline_pictures=true"], tmp_path)
    assert warnings_shown(proc) == []
    (summary_path,) = tmp_path.rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert (summary["K"], summary["M"], summary["schedule"]) == (2, 4, "gpipe")
    assert summary["steps"] == 6
    assert summary["validation_metric"] == "val/acc" and 0 <= summary["validation_value"] <= 1
    assert summary["samples_per_s"] > 0 and summary["bubble_theory"] == pytest.approx(0.2)
    assert 0 <= summary["bubble_measured"] < 1
    assert len(summary["stage_parameter_bytes"]) == 2 and min(summary["stage_peak_activation_bytes"]) > 0
    run_dir = summary_path.parent
    assert (run_dir / "timeline_first.png").exists() and (run_dir / "timeline_last.png").exists()
    (wandb_file,) = find_run_files(run_dir / "wandb")
    run = read_run(wandb_file)
    assert run.config["pipeline"]["chunks"] == 4  # the resolved Hydra config
    losses = run.metric("train/loss")
    assert len(losses) >= 3 and all(v > 0 for v in losses)
    for key in ("perf/samples_per_s", "pipeline/bubble_measured", "pipeline/bubble_theory",
                "pipeline/stage1_busy_s", "memory/stage0_param_bytes", "memory/stage1_activation_bytes", "val/acc"):
        assert run.metric(key), key
    assert any(k.startswith("pipeline/timeline") for row in run.history for k in row)
    assert sum("media/images/pipeline/timeline" in f for f in run.files) >= 2
    assert run.summary["K"] == 2 and "validation_value" in run.summary


@pytest.mark.slow
def test_multirun_sweep_is_one_wandb_group_with_a_summary_table(tmp_path: Path) -> None:
    gpipe_train(["-m", "pipeline.partitions=1,2", "pipeline.chunks=1,4", *SMALL, "trainer.max_steps=2",
                 "trainer.enable_progress_bar=false", "data.num_val=16"], tmp_path, timeout=400)
    (table,) = tmp_path.rglob("multiruns/*/summary.json")
    sweep_dir = table.parent
    rows = json.loads(table.read_text())
    assert sorted((r["K"], r["M"]) for r in rows) == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert (sweep_dir / "summary.csv").exists()
    for row in rows:
        assert row["final_train_loss"] > 0 and row["samples_per_s"] > 0
    markdown = (sweep_dir / "sweep_summary.md").read_text().splitlines()
    assert markdown[2].startswith("| job | run | K | M | schedule |") and len(markdown) == 4 + len(rows)
    assert "| K2-M4-gpipe | 2 | 4 | gpipe |" in "\n".join(markdown)

    jobs = [read_run(f) for d in sorted(sweep_dir.glob("[0-9]*")) for f in find_run_files(d / "wandb")]
    assert sorted(run.name for run in jobs) == ["K1-M1-gpipe", "K1-M4-gpipe", "K2-M1-gpipe", "K2-M4-gpipe"]
    assert {run.group for run in jobs} == {sweep_dir.name}
    for run in jobs:
        assert run.name == f"K{run.config['K']}-M{run.config['M']}-gpipe"
        assert (run.config["schedule"], run.config["checkpoint"], run.config["transport"]) == \
            ("gpipe", "except_last", "local")
    (summary_file,) = find_run_files(sweep_dir / "wandb")
    summary_run = read_run(summary_file)
    assert (summary_run.group, summary_run.name) == (sweep_dir.name, f"{sweep_dir.name}-summary")
    (table_file,) = set((sweep_dir / "wandb").rglob("*.table.json"))
    logged = json.loads(table_file.read_text())
    assert logged["columns"][:4] == ["job", "run", "K", "M"] and len(logged["data"]) == len(rows)
    by_run = {r[1]: dict(zip(logged["columns"], r)) for r in logged["data"]}
    for row in rows:
        assert by_run[row["run_name"]]["samples/s"] == pytest.approx(row["samples_per_s"])
        assert by_run[row["run_name"]]["value"] == pytest.approx(row["validation_value"])
        assert by_run[row["run_name"]]["bubble"] == pytest.approx(row["bubble_measured"])


def test_bad_override_fails_before_training(tmp_path: Path, capsys, monkeypatch) -> None:
    """In this process (``helpers.app.cli_here``): the refusal needs no new process's imports."""
    done = cli_here(tmp_path, capsys, monkeypatch)("pipeline.chunks=64")
    assert done.code not in (0, None)
    assert "pipeline.chunks" in f"{done.code} {done.out} {done.err}"
    assert not list(tmp_path.rglob("*.wandb"))

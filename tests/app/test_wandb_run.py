"""A job's wandb run: named by what the pipeline runs, grouped by its sweep (or ``logger.group``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpipe_lab.app.wandb_reader import find_run_files, read_run
from gpipe_lab.app.wandb_run import finish_and_flush, run_config, run_name, sweep_group
from gpipe_lab.pipeline.options import PipelineOptions
from helpers.app import make_config


def test_run_name_says_what_runs_and_what_differs_from_the_defaults() -> None:
    assert run_name(PipelineOptions(partitions=2, chunks=8, schedule="gpipe-bw")) == "K2-M8-gpipe-bw"
    assert run_name(PipelineOptions(partitions=3, chunks=4, checkpoint="never", transport="distributed",
                                    virtual_stages=2)) == "K3-M4-gpipe-ckpt_never-distributed-v2"


def test_group_is_logger_group_else_none_outside_a_sweep(tmp_path: Path) -> None:
    assert sweep_group(make_config(), tmp_path / "run") is None
    assert sweep_group(make_config("logger.group=ablation"), tmp_path / "run") == "ablation"


def test_run_config_has_flat_keys_to_group_and_plot_by() -> None:
    config = run_config({"pipeline": {"chunks": 8}}, PipelineOptions(partitions=2, chunks=8, transport="distributed"))
    assert {k: config[k] for k in ("K", "M", "schedule", "checkpoint", "transport", "compile")} == {
        "K": 2, "M": 8, "schedule": "gpipe", "checkpoint": "except_last", "transport": "distributed",
        "compile": False}
    assert config["pipeline"] == {"chunks": 8}


def test_a_finished_run_file_is_whole_when_finish_and_flush_returns(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``wandb.finish`` alone can return before the service wrote the file (seen empty in 1 of 15
    offline runs); each of these runs is read the moment ``finish_and_flush`` returns."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for i in range(4):
        folder = tmp_path / str(i)
        run = wandb.init(dir=str(folder), project="gpipe-lab-test", config={"i": i})
        for step in range(3):
            run.log({"x": step})
        finish_and_flush(run if i % 2 else None)  # a given run, and the current one
        (path,) = find_run_files(folder)
        written = read_run(path)
        assert written.kinds.get("exit") == 1 and written.metric("x") == [0, 1, 2], written.kinds

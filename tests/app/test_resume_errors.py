"""Resume mistakes get one line, not a traceback (issue 46): a checkpoint path naming a file that is no
checkpoint (another kind of file, a truncated one) or a run directory, stage devices this machine does
not have (refused before wandb starts and leaving no run folder), and an experiment script's
``--from-multirun`` on a folder without gpipe-train jobs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from helpers.app import SMALL, Done, cli_here, one_line


@pytest.fixture
def gpipe_train(tmp_path, capsys, monkeypatch) -> Callable[..., Done]:
    """``gpipe-train ARGS`` in this process (``helpers.app.cli_here``)."""
    return cli_here(tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("kind", ["text", "truncated", "empty"])
def test_a_file_that_is_no_whole_checkpoint_is_one_line_before_anything_starts(gpipe_train, tmp_path, kind):
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 1}, whole)
    content = {"text": b"not a checkpoint\n", "truncated": whole.read_bytes()[:2000], "empty": b""}[kind]
    bad = tmp_path / f"{kind}.ckpt"
    bad.write_bytes(content)
    small = [o for o in SMALL if o != "logger=none"]
    line = one_line(gpipe_train(f"ckpt_path={bad}", "logger=wandb", *small))
    assert line == (f"config error: ckpt_path={bad}: not a checkpoint torch can read (neither a zip archive nor a "
                    f"pickle: damaged, truncated or another kind of file); give a run's checkpoints/last.ckpt")
    assert not list(tmp_path.rglob("wandb")) and not list(tmp_path.rglob("*.yaml"))


def test_a_zip_archive_torch_cannot_read_is_one_line(gpipe_train, tmp_path):
    import zipfile

    bad = tmp_path / "other.zip"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("notes.txt", "a zip file, not a checkpoint")
    line = one_line(gpipe_train(f"ckpt_path={bad}", *SMALL))
    assert line.startswith(f"config error: ckpt_path={bad}: not a checkpoint torch can read (RuntimeError: ")
    assert "checkpoints/last.ckpt" in line


def test_a_sweep_with_a_damaged_checkpoint_is_refused_before_any_job_trains(gpipe_train, tmp_path):
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(b"not a checkpoint")
    done = gpipe_train("-m", f"ckpt_path=null,{damaged}", *SMALL, "trainer.max_steps=1")
    assert isinstance(done.code, str) and "config error in 1 of 2 sweep jobs" in done.code, done.code
    assert "not a checkpoint torch can read" in done.code
    assert not list(tmp_path.rglob("summary.json"))  # nothing trained


def test_a_plain_state_dict_is_no_checkpoint_to_resume(gpipe_train, tmp_path):
    weights = tmp_path / "weights.pt"
    torch.save({"0.weight": torch.zeros(2)}, weights)
    line = one_line(gpipe_train(f"ckpt_path={weights}", *SMALL))
    assert f"ckpt_path={weights}: not a gpipe-train checkpoint" in line and "init_from" in line


def test_a_run_directory_names_its_last_checkpoint(gpipe_train, tmp_path):
    run_dir = tmp_path / "old_run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    line = one_line(gpipe_train(f"ckpt_path={run_dir}", *SMALL))
    assert line == (f"config error: ckpt_path={run_dir}: a run directory, not a checkpoint; resume its newest one "
                    f"with ckpt_path={run_dir}/checkpoints/last.ckpt")


def test_stage_devices_this_machine_lacks_are_refused_before_wandb_and_the_run_folder(gpipe_train, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    small = [o for o in SMALL if o != "logger=none"]
    line = one_line(gpipe_train("pipeline.devices=[cuda:0,cuda:1]", "logger=wandb", *small))
    assert line == ("config error: pipeline.devices=['cuda:0', 'cuda:1']: device 'cuda:0' asks for CUDA, but "
                    "CUDA is not available here; use 'cpu'")
    assert not list(tmp_path.rglob("wandb")), "no wandb run was started"
    assert not list(tmp_path.rglob("*.yaml")), "a refused run leaves no run folder behind"


@pytest.mark.parametrize("script", ["table2_throughput", "table3_throughput", "overheads", "trainability",
                                    "nmt_scaling", "microbatch_cost"])
def test_an_experiment_scripts_from_multirun_on_a_wrong_folder_is_one_line(script, tmp_path, monkeypatch, capsys):
    import importlib

    from experiments.common import run_main

    module = importlib.import_module(f"experiments.{script}")
    (tmp_path / "not_a_sweep").mkdir()
    for folder in (tmp_path / "nowhere", tmp_path / "not_a_sweep"):
        monkeypatch.setattr(sys, "argv", [module.__file__, "--from-multirun", str(folder), "--out", str(tmp_path)])
        with pytest.raises(SystemExit) as info:
            run_main(module.main)
        assert isinstance(info.value.code, str) and "\n" not in info.value.code, info.value.code
        assert info.value.code.startswith("--from-multirun: ") and str(folder) in info.value.code

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

from helpers.app import SMALL, Done, cli_here


@pytest.fixture
def gpipe_train(tmp_path, capsys, monkeypatch) -> Callable[..., Done]:
    """``gpipe-train ARGS`` in this process (``helpers.app.cli_here``)."""
    return cli_here(tmp_path, capsys, monkeypatch)


def one_line(done: Done) -> str:
    assert isinstance(done.code, str), (done.code, done.err[-3000:])
    assert "\n" not in done.code and "Traceback" not in done.err, done.code
    return done.code


def test_a_file_that_is_no_checkpoint_is_one_line(gpipe_train, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    line = one_line(gpipe_train(f"ckpt_path={notes}", *SMALL))
    assert line.startswith(f"config error: ckpt_path={notes}: not a checkpoint torch can read (UnpicklingError")
    assert "checkpoints/last.ckpt" in line


def test_a_truncated_checkpoint_is_one_line(gpipe_train, tmp_path):
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 1}, whole)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[:2000])
    line = one_line(gpipe_train(f"ckpt_path={cut}", *SMALL))
    assert f"ckpt_path={cut}: not a checkpoint torch can read (RuntimeError: PytorchStreamReader failed" in line


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

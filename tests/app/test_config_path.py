"""A run prints where Hydra saved the config it composed (``<run dir>/.hydra/config.yaml``) before it
trains; that file is the run's whole config (issue 46)."""

from __future__ import annotations

from omegaconf import OmegaConf

from helpers.app import SMALL, cli_here


def test_a_run_prints_the_path_of_its_composed_config_first(tmp_path, capsys, monkeypatch):
    done = cli_here(tmp_path, capsys, monkeypatch)(*SMALL, "trainer.max_steps=1", "model.num_layers=6")
    assert done.code in (0, None), done.err[-3000:]
    (saved,) = tmp_path.glob("train/runs/*/.hydra/config.yaml")
    lines = done.out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("config: "))
    assert lines[first].startswith(f"config: {saved} ")
    assert first < next(i for i, line in enumerate(lines) if line.startswith("pipeline: K="))  # before training
    assert OmegaConf.load(saved).model.num_layers == 6

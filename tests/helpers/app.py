"""Running the app in tests: composed configs in-process, ``gpipe-train`` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from gpipe_lab.app.train import CONFIG_DIR, cli
from helpers.forked import run_module, run_torchrun

CONF = Path(CONFIG_DIR)
#: runs through these helpers draw no timeline pictures (~0.2 s each, two per run) unless a test asks
PICTURES = "callbacks.timeline_pictures"


def without_pictures(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """``overrides``, drawing no timeline pictures unless they set ``callbacks.timeline_pictures``."""
    asked = any(o.lstrip("+").startswith(PICTURES) for o in overrides)
    return list(overrides) if asked else [*overrides, f"{PICTURES}=false"]


def make_config(*overrides: str, tmp_path: Path | None = None) -> DictConfig:
    GlobalHydra.instance().clear()
    extra = [f"paths.log_dir={tmp_path}"] if tmp_path is not None else []
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose("train", overrides=[*without_pictures(overrides), *extra], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    GlobalHydra.instance().clear()
    if tmp_path is not None:
        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp_path / "run")
    return cfg


def gpipe_train(args: list[str], tmp_path: Path, timeout: float = 240, torchrun: int | None = None,
                ) -> subprocess.CompletedProcess:
    """``gpipe-train *args`` with its logs under ``tmp_path``, forked (``helpers.forked``); with
    ``torchrun=N`` as ``torchrun --nproc-per-node N -m gpipe_lab.app.train`` (each rank forked, none started
    by Lightning's launcher in a fresh interpreter)."""
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "1"}
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    argv = [*flags, f"paths.log_dir={tmp_path}", *without_pictures(overrides)]
    if torchrun is None:
        proc = run_module("gpipe_lab.app.train", argv, cwd=tmp_path, env=env, timeout=timeout)
    else:
        proc = run_torchrun(torchrun, "gpipe_lab.app.train", argv, cwd=tmp_path, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


#: the smallest default-model run a user could type
SMALL = ["trainer=smoke", "logger=none", "data.num_train=16", "data.num_val=8", "data.batch_size=8",
         "model.num_filters=8", "data.image_size=8", "model.image_size=8"]


def user_app(args: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``gpipe-train`` as a user runs it (no HYDRA_FULL_ERROR), in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    return run_module("gpipe_lab.app.train", [*args, f"paths.log_dir={tmp_path}"], cwd=tmp_path, env=env,
                      timeout=timeout)


@dataclass
class Done:
    """What ``gpipe-train`` left: its exit status (or message) and what it printed."""

    code: int | str | None
    out: str
    err: str


def one_line(done: Done) -> str:
    """A refused command's message: it exits with one line (Python prints it, status 1)."""
    assert isinstance(done.code, str), (done.code, done.err[-3000:])
    assert "\n" not in done.code and "Traceback" not in done.err, done.code
    return done.code


def cli_here(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Done]:
    """``gpipe-train ARGS`` in this process (the console script's ``cli``, the user's ``sys.argv``,
    cwd ``tmp_path``): the same command line without paying a new process's imports."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def call(*args: str) -> Done:
        monkeypatch.setattr(sys, "argv", ["gpipe-train", *without_pictures(args), f"paths.log_dir={tmp_path}"])
        code: int | str | None = 0
        try:
            cli()
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return Done(code, out.out, out.err)
    return call


def numbered_copy(ckpt: Path, out: Path) -> None:
    """A copy of the checkpoint ``ckpt`` whose ``layers.<name>.`` weights are ``layers.<index>.``: what the
    distributed transport wrote before it kept the layer names."""
    import torch

    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    names: dict[str, int] = {}
    for key in state["state_dict"]:
        if key.startswith("layers."):
            names.setdefault(key.split(".")[1], len(names))
    state["state_dict"] = {(f"layers.{names[k.split('.')[1]]}.{k.split('.', 2)[2]}" if k.startswith("layers.") else k): v
                           for k, v in state["state_dict"].items()}
    torch.save(state, out)

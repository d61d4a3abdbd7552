"""The config against this machine: what it names must exist here, checked by
``gpipe_lab.app.config.check_config`` after the groups' own checks.

- the model's layer count (the model is built on the ``meta`` device: nothing is allocated, so
  Table 1's giants cost no memory), which the pipeline is checked against;
- the checkpoint to resume (``ckpt_path``, ``last`` included) or to start from (``init_from``)
  exists, and the one to resume is a whole checkpoint file (a sweep refuses a damaged one first);
- ``trainer=gpu`` finds a GPU, and ``pipeline.devices`` names devices this machine has;
- under torchrun, its world size is a multiple of K.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from gpipe_lab.app.config.schema import ConfigError, resolved_dict
from gpipe_lab.lightning.resume import resolve_ckpt_path
from gpipe_lab.models import build
from gpipe_lab.pipeline.devices.assignment import resolve_devices
from gpipe_lab.pipeline.distributed.topology import check_world
from gpipe_lab.pipeline.options import PipelineOptions

#: How to quote a checkpoint path holding ``=`` (Lightning's ``epoch=0-step=60.ckpt``) for Hydra.
QUOTING = "quote a path holding '=' as \"ckpt_path='.../epoch=0-step=60.ckpt'\""


def model_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The ``model`` group's ``gpipe_lab.models.build`` overrides (all but ``name`` and ``task``)."""
    return {k: v for k, v in resolved_dict(cfg.model).items() if k not in ("name", "task")}


def layer_count(cfg: DictConfig) -> int:
    """The number of layers of the model ``cfg`` builds (built on the meta device).

    Raises:
        ConfigError: the model's overrides do not build (naming ``model``).
    """
    try:
        return len(build(cfg.model.name, device="meta", **model_overrides(cfg)))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model={cfg.model.name}: {exc}") from None


def runs_dir_of(cfg: DictConfig) -> Path:
    """Where ``ckpt_path=last`` looks for runs: ``${paths.log_dir}/${task_name}/runs``."""
    return Path(cfg.paths.log_dir) / cfg.task_name / "runs"


def resolve_checkpoint(cfg: DictConfig, output_dir: Path | None = None) -> str | None:
    """``ckpt_path`` as a file that exists: a path as given, or for ``last`` this run directory's
    ``checkpoints/last.ckpt``, else the newest ``*/checkpoints/last.ckpt`` of earlier runs.

    Raises:
        ConfigError: ``last`` with no run to resume, a run directory (its ``checkpoints/last.ckpt``
            named), a path that is not a file, or a file that is no whole checkpoint.
    """
    given = cfg.get("ckpt_path")
    if given is None:
        return None
    try:
        given = resolve_ckpt_path(str(given), output_dir, runs_dir_of(cfg))  # the rule of ``last``
    except FileNotFoundError:
        raise ConfigError(f"ckpt_path=last: no run under {runs_dir_of(cfg)} has a checkpoints/last.ckpt yet; "
                          f"train one first (gpipe-train), or give ckpt_path=<run dir>/checkpoints/last.ckpt") from None
    for last in (Path(str(given)) / "checkpoints" / "last.ckpt", Path(str(given)) / "last.ckpt"):
        if last.is_file():
            raise ConfigError(f"ckpt_path={given}: a run directory, not a checkpoint; resume its newest one with "
                              f"ckpt_path={last}")
    if not Path(str(given)).is_file():
        raise ConfigError(f"ckpt_path={given}: no such file; give a run's checkpoint, e.g. "
                          f"ckpt_path={runs_dir_of(cfg)}/<time>/checkpoints/last.ckpt, or ckpt_path=last "
                          f"(the newest run's); {QUOTING}")
    if not looks_like_a_checkpoint(Path(str(given))):
        raise ConfigError(f"ckpt_path={given}: not a checkpoint torch can read (neither a zip archive nor a "
                          f"pickle: damaged, truncated or another kind of file); give a run's checkpoints/last.ckpt")
    return str(given)


def looks_like_a_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a whole ``torch.save`` file: a zip archive whose directory at its end is
    there (the format since torch 1.6), or a legacy pickle. Reads its first bytes and its end only."""
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"  # pickle's PROTO opcode


def check_init_from(cfg: DictConfig) -> None:
    """Raises: ConfigError: ``init_from`` names no file."""
    given = cfg.get("init_from")
    if given is not None and not Path(str(given)).is_file():
        raise ConfigError(f"init_from={given}: no such file; give a run's checkpoints/last.ckpt; {QUOTING}")


def check_accelerator(cfg: DictConfig) -> None:
    """Raises: ConfigError: ``trainer.accelerator`` asks for a GPU and none is visible."""
    accelerator = cfg.trainer.get("accelerator")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator}: no CUDA GPU is visible on this machine "
                          f"(torch.cuda.is_available() is False); use trainer=cpu (the default), or run where "
                          f"nvidia-smi lists GPUs")


def check_devices(options: PipelineOptions) -> None:
    """Raises: ConfigError: ``pipeline.devices`` names a device this machine does not have (or too few)."""
    if options.devices is None:
        return
    try:
        resolve_devices(options.devices, options.num_stages)
    except ValueError as exc:
        raise ConfigError(f"pipeline.devices={options.devices}: {exc}") from None


def check_launcher_world_size(options: PipelineOptions) -> None:
    """Raises: ConfigError: a launcher's ``WORLD_SIZE`` (torchrun) that K does not divide."""
    world = os.environ.get("WORLD_SIZE")
    k = options.num_stages
    if options.transport == "distributed" and world and world.isdigit():
        try:
            check_world(int(world), k, what=f"pipeline.partitions={k}: torchrun started {world} processes "
                        f"(--nnodes x --nproc-per-node), which", stages="K", fix=f"use --nproc-per-node {k} "
                        f"(or a multiple of {k}), or a pipeline.partitions dividing {world}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

"""The wandb run of one ``gpipe-train`` job: its group, its name and the config a dashboard plots by.

- group: ``logger.group`` when set, else in a Hydra multirun the sweep's folder name, so that
  the jobs of one sweep land together (``None`` for a single run);
- name: what the pipeline runs, e.g. ``K2-M8-gpipe-bw`` (schedule ``gpipe-bw``), with the
  settings that differ from their defaults appended (``-ckpt_never``, ``-distributed``, ``-v2``,
  ``-compile``), and in a sweep the job's values of the other keys the sweep varies
  (``K2-M4-gpipe-optimizer.lr=0.01``);
- config: the resolved Hydra config plus flat ``K``, ``M``, ``schedule``, ``checkpoint``,
  ``transport`` and ``compile`` keys.

A run resumed from a checkpoint (``ckpt_path``) continues the wandb run of the checkpoint's run
directory under the same id, rewound (``resume_from="<id>?_step=<n>"``) to its last history row
before the checkpoint's step: rows a killed run logged past its checkpoint are dropped, so no
step has two values once synced (``gpipe_lab.app.wandb_reader.synced_history`` reads it so offline);
its config's ``resumed_from_step`` is the checkpoint's training step.

The run is created here (``wandb.init``) and handed to Lightning's ``WandbLogger`` as its
``experiment``, on global rank 0 only; other ranks get a logger that never starts a run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from gpipe_lab.pipeline.options import PipelineOptions


def sweep_group(cfg: DictConfig, output_dir: Path) -> str | None:
    """``logger.group``, else the multirun's sweep folder name (the job folder's parent), else ``None``."""
    if cfg.logger.get("group"):
        return str(cfg.logger.group)
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return output_dir.parent.name
    return None


#: The pipeline keys whose value the name already shows (``K2``, ``M4``, the schedule, ...).
NAMED_KEYS = ("pipeline.partitions", "pipeline.chunks", "pipeline.schedule", "pipeline.checkpoint",
              "pipeline.transport", "pipeline.virtual_stages", "pipeline.compile")


def run_name(options: PipelineOptions, swept: Mapping[str, str] | None = None) -> str:
    """``K<K>-M<M>-<schedule>`` and the non-default settings, e.g. ``K2-M8-gpipe-bw-ckpt_never``,
    then ``key=value`` for each key of ``swept`` (what a sweep varies) the name does not show yet."""
    defaults = PipelineOptions()
    parts = [f"K{options.num_stages}", f"M{options.chunks}", options.schedule]
    if options.checkpoint != defaults.checkpoint:
        parts.append(f"ckpt_{options.checkpoint}")
    if options.transport != defaults.transport:
        parts.append(options.transport)
    if options.virtual_stages != defaults.virtual_stages:
        parts.append(f"v{options.virtual_stages}")
    if getattr(options, "compile", False):
        parts.append("compile")
    parts += [f"{key}={value}" for key, value in (swept or {}).items() if key not in NAMED_KEYS]
    return "-".join(parts)


def job_run_name(options: PipelineOptions) -> str:
    """``run_name`` of this Hydra job: with the values of what its sweep varies."""
    from gpipe_lab.app.sweep_check import job_sweep_values

    return run_name(options, job_sweep_values())


def run_config(resolved: dict[str, Any], options: PipelineOptions) -> dict[str, Any]:
    """The resolved config with the flat keys a dashboard groups and plots by."""
    flat = {"K": options.num_stages, "M": options.chunks, "schedule": options.schedule,
            "checkpoint": options.checkpoint, "transport": options.transport,
            "virtual_stages": options.virtual_stages, "compile": getattr(options, "compile", False)}
    return {**resolved, **flat}


def checkpoint_step(ckpt_path: str) -> int:
    """The training step a Lightning checkpoint was saved at (its ``global_step``)."""
    import torch

    return int(torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)["global_step"])


def resume_arguments(ckpt_path: str | None) -> dict[str, Any]:
    """``wandb.init``'s arguments that continue the wandb run of ``ckpt_path``'s run directory
    (``<run>/checkpoints/<file>``), rewound to before the checkpoint's step; none without one."""
    if ckpt_path is None:
        return {}
    runs = sorted(Path(ckpt_path).resolve().parent.parent.glob("wandb/*run-*-*/run-*.wandb"),
                  key=lambda p: p.parent.name.split("run-", 1)[1])
    if not runs:
        return {}
    from gpipe_lab.app.wandb_reader import read_run

    run_id = runs[-1].stem.removeprefix("run-")
    step = checkpoint_step(ckpt_path)
    rows = [row for row in read_run(runs[-1], cut_end=True).history if "_step" in row]
    after = next((i for i, row in enumerate(rows) if row.get("trainer/global_step", -1) >= step), len(rows))
    if after == 0:  # nothing logged before the checkpoint's step in this file: cannot rewind to it
        print(f"wandb run {run_id} ({runs[-1]}) holds no row before the checkpoint's step {step}: continuing it "
              "as it is", file=sys.stderr)
        return {"id": run_id, "resume": "allow"}
    return {"id": run_id, "resume_from": f"{run_id}?_step={int(rows[after - 1]['_step'])}"}


def console_settings(mode: str) -> Any:
    """``wandb.Settings`` for wandb's console output: none for an offline or disabled run
    (``gpipe-train``'s last line names the run's wandb folder), only the run's address online
    (``quiet``: without wandb's 35-line history and summary block); ``WANDB_SILENT`` or
    ``WANDB_QUIET``, when set, decide instead."""
    import wandb

    if "WANDB_SILENT" in os.environ or "WANDB_QUIET" in os.environ:
        return wandb.Settings()
    return wandb.Settings(quiet=True) if mode == "online" else wandb.Settings(silent=True)


def build_wandb_logger(cfg: DictConfig, output_dir: Path, options: PipelineOptions,
                       resolved: dict[str, Any], ckpt_path: str | None = None) -> Any:
    """A ``WandbLogger`` writing to ``output_dir/wandb``, continuing ``ckpt_path``'s wandb run
    (see the module docstring)."""
    from lightning.pytorch.loggers import WandbLogger

    from gpipe_lab.app.run_console import global_rank

    output_dir.mkdir(parents=True, exist_ok=True)
    name = job_run_name(options)
    experiment = None
    if global_rank() == 0:
        import wandb

        common = dict(dir=str(output_dir), project=cfg.logger.project, entity=cfg.logger.entity,
                      group=sweep_group(cfg, output_dir), tags=list(cfg.logger.tags or []), mode=cfg.logger.mode,
                      name=name, config=run_config(resolved, options), job_type="train",
                      settings=console_settings(cfg.logger.mode))
        resume = resume_arguments(ckpt_path)
        if resume:  # the training step the continued run starts from (wandb's branch point counts rows)
            common["config"]["resumed_from_step"] = checkpoint_step(str(ckpt_path))
        try:
            experiment = wandb.init(**common, **resume)
        except wandb.Error as exc:
            if "resume_from" not in resume:
                raise
            # a server without run rewinding: continue the run as it is (its later rows stay)
            print(f"wandb could not rewind run {resume['id']} to before the checkpoint ({exc}); continuing it "
                  "as it is: steps it logged after the checkpoint will show two values", file=sys.stderr)
            experiment = wandb.init(**common, id=resume["id"], resume="allow")
        # The x-axis Lightning's WandbLogger declares when it starts a run itself.
        experiment.define_metric("trainer/global_step")
        experiment.define_metric("*", step_metric="trainer/global_step", step_sync=True)
    return WandbLogger(experiment=experiment, save_dir=str(output_dir), project=cfg.logger.project, name=name)


def finish_and_flush(run: Any | None = None) -> None:
    """Finish ``run`` (default: the current run) and wait until wandb has written its files.

    ``finish`` can return before wandb's service process has written the run's ``.wandb`` file
    (seen empty right after ``finish`` in 1 of 15 offline runs on a quiet machine); a run resumed
    in the same process and ``gpipe_lab.app.wandb_reader`` read that file next. ``teardown`` waits for
    the service; the next run in this process starts a new one.
    """
    import wandb

    if run is not None:
        run.finish()
    else:
        wandb.finish()
    wandb.teardown()

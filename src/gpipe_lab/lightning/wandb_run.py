"""The wandb run of one ``gpipe-train`` job: its group, its name and the config a dashboard plots by.

- group: ``logger.group`` when set, else in a Hydra multirun the sweep's folder name, so that
  the jobs of one sweep land together (``None`` for a single run);
- name: what the pipeline runs, e.g. ``K2-M8-gpipe-bw`` (schedule ``gpipe-bw``), with the
  settings that differ from their defaults appended (``-ckpt_never``, ``-distributed``, ``-v2``,
  ``-compile``);
- config: the resolved Hydra config plus flat ``K``, ``M``, ``schedule``, ``checkpoint``,
  ``transport`` and ``compile`` keys.

The run is created here (``wandb.init``) and handed to Lightning's ``WandbLogger`` as its
``experiment``, on global rank 0 only; other ranks get a logger that never starts a run.
"""

from __future__ import annotations

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


def run_name(options: PipelineOptions) -> str:
    """``K<K>-M<M>-<schedule>`` and the non-default settings, e.g. ``K2-M8-gpipe-bw-ckpt_never``."""
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
    return "-".join(parts)


def run_config(resolved: dict[str, Any], options: PipelineOptions) -> dict[str, Any]:
    """The resolved config with the flat keys a dashboard groups and plots by."""
    flat = {"K": options.num_stages, "M": options.chunks, "schedule": options.schedule,
            "checkpoint": options.checkpoint, "transport": options.transport,
            "virtual_stages": options.virtual_stages, "compile": getattr(options, "compile", False)}
    return {**resolved, **flat}


def build_wandb_logger(cfg: DictConfig, output_dir: Path, options: PipelineOptions,
                       resolved: dict[str, Any]) -> Any:
    """A ``WandbLogger`` writing to ``output_dir/wandb`` (see the module docstring)."""
    from lightning.pytorch.loggers import WandbLogger
    from lightning.pytorch.utilities import rank_zero_only

    output_dir.mkdir(parents=True, exist_ok=True)
    name = run_name(options)
    experiment = None
    if rank_zero_only.rank == 0:
        import wandb

        experiment = wandb.init(dir=str(output_dir), project=cfg.logger.project, entity=cfg.logger.entity,
                                group=sweep_group(cfg, output_dir), tags=list(cfg.logger.tags or []),
                                mode=cfg.logger.mode, name=name, config=run_config(resolved, options),
                                job_type="train")
        # The x-axis Lightning's WandbLogger declares when it starts a run itself.
        experiment.define_metric("trainer/global_step")
        experiment.define_metric("*", step_metric="trainer/global_step", step_sync=True)
    return WandbLogger(experiment=experiment, save_dir=str(output_dir), project=cfg.logger.project, name=name)

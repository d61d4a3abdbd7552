"""The app's config, checked in one place: ``check_config(cfg, output_dir)`` takes the composed
config and returns it checked (a ``CheckedConfig``), or raises one ``ConfigError`` naming the key,
the value and what is allowed, before anything is built, logged or trained.

``gpipe-train`` calls it once per run (after ``gpipe_lab.app.continuation`` has recomposed a
continued run's config); its dry run (``dry_run=true``) and each job of a sweep
(``gpipe_lab.app.sweep_check``) make the same call. Its sections, in the order it runs them:

- ``groups``: keys, values and combinations of the groups (``mistakes``: a first-time user's
  mistakes; ``planner``: the ``pipeline.plan`` keys), nothing built or read;
- ``environment``: what the config names exists on this machine: the model's layers (built on
  ``meta``), the checkpoint to resume or start from, the GPUs and devices, the launcher's world.

``schema`` holds the error type and the nodes generated from the dataclasses. ``resume`` compares
a checkpoint with the built module; the run calls it once the module exists (``run_start``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig

from gpipe_lab.app.config.environment import (
    check_accelerator,
    check_devices,
    check_init_from,
    check_launcher_world_size,
    layer_count,
    resolve_checkpoint,
)
from gpipe_lab.app.config.groups import CheckedConfig, validate, validate_layer_count
from gpipe_lab.app.config.schema import ConfigError

__all__ = ["CheckedConfig", "ConfigError", "check_config"]


def check_config(cfg: DictConfig, output_dir: Path | None = None) -> CheckedConfig:
    """Every check a run makes before it trains (see the module docstring); ``output_dir``: the
    run's directory, where ``ckpt_path=last`` looks first.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    checked = validate(cfg)
    num_layers = layer_count(cfg)  # the groups first: a model they refuse is not built
    validate_layer_count(cfg, checked.options, num_layers)
    ckpt_path = resolve_checkpoint(cfg, output_dir)
    check_init_from(cfg)
    check_accelerator(cfg)
    check_devices(checked.options)
    check_launcher_world_size(checked.options)
    return replace(checked, ckpt_path=ckpt_path, num_layers=num_layers)

"""``pipeline.plan=auto``: the app's planner keys, checked, and the chosen plan applied to a run.

The keys live in the ``pipeline`` group beside the engine's options but are the app's, not
``PipelineOptions`` fields (the engine knows nothing of planning):

- ``pipeline.plan``: ``manual`` (default: run the pipeline options as given) or ``auto`` (choose
  ``partitions``, ``balance``, ``chunks``, ``schedule`` and ``checkpoint`` with ``planner.auto``, then
  run them; the other pipeline options stay as given);
- ``pipeline.memory_per_device``: the budget per stage, e.g. ``8GiB``, ``512MiB``, ``1.5GB`` (needed
  by ``auto``);
- ``pipeline.devices_available``: stages that can run side by side (default: the GPUs, else the
  CPU cores: one thread per stage);
- ``pipeline.schedules_allowed``: the schedules searched (default: ``planner.auto.DEFAULT_SCHEDULES``);
- ``pipeline.plan_trials``: how many of the fastest predicted plans that fit are run for a few steps
  before choosing, the fastest measured winning (default ``planner.plan_types.DEFAULT_TRIALS``, 3; 0:
  choose by the prediction alone).

What ``auto`` compares with its budget, per stage: parameter state (parameters x bytes per
parameter of the optimizer, ``auto_run.bytes_per_param_of``) plus the peak saved-activation
bytes the engine tracks (``track_memory``, the ``SavedBytes`` rule); the run's ``summary.json``
records the same sum measured (parameter bytes from the stages, activations from the engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpipe_lab.app.config.schema import ConfigError
from gpipe_lab.planner.plan_types import DEFAULT_TRIALS

__all__ = ["PLANNER_KEYS", "PlannerConfig", "engine_section", "validate_planner"]

PLANNER_KEYS = ("plan", "memory_per_device", "devices_available", "schedules_allowed", "plan_trials")
PLANS = ("manual", "auto")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner keys, checked; ``budget_bytes`` is ``memory_per_device`` in bytes (None: not given)."""

    plan: str = "manual"
    budget_bytes: int | None = None
    devices: int | None = None
    schedules: tuple[str, ...] | None = None
    trials: int = DEFAULT_TRIALS

    @property
    def auto(self) -> bool:
        return self.plan == "auto"


def engine_section(pipeline: Any) -> Any:
    """The ``pipeline`` group without the planner keys (what ``PipelineOptions`` is built from)."""
    if not isinstance(pipeline, DictConfig):
        return pipeline
    # resolved while attached: an interpolation into the rest of the config still resolves
    values = OmegaConf.to_container(pipeline, resolve=True)
    return OmegaConf.create({k: v for k, v in values.items() if k not in PLANNER_KEYS})  # type: ignore[union-attr]


def validate_planner(cfg: DictConfig) -> PlannerConfig:
    """The planner keys of ``cfg.pipeline`` (see the module docstring).

    Raises:
        ConfigError: one line naming ``pipeline.<key>``, the value and what is allowed.
    """
    from gpipe_lab.pipeline.schedules import SCHEDULES
    from gpipe_lab.planner.memory_size import parse_memory

    section = cfg.pipeline
    plan = section.get("plan", "manual")
    if plan not in PLANS:
        raise ConfigError(f"pipeline.plan: must be one of {list(PLANS)}, got {plan!r}")
    memory = section.get("memory_per_device")
    try:
        budget = None if memory is None else parse_memory(memory, "pipeline.memory_per_device")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    devices = section.get("devices_available")
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
        raise ConfigError(f"pipeline.devices_available: must be an integer >= 1 or null (GPUs, else CPU "
                          f"cores), got {devices!r}")
    schedules = section.get("schedules_allowed")
    if schedules is not None:
        names = list(schedules) if isinstance(schedules, (ListConfig, list, tuple)) else [schedules]
        if not names or any(n not in SCHEDULES for n in names):
            raise ConfigError(f"pipeline.schedules_allowed: must be null or a non-empty list of "
                              f"{sorted(SCHEDULES)}, got {names!r}")
        schedules = tuple(names)
    trials = section.get("plan_trials", DEFAULT_TRIALS)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 0:
        raise ConfigError(f"pipeline.plan_trials: must be an integer >= 0 (0: choose by the prediction alone), "
                          f"got {trials!r}")
    if plan == "auto" and budget is None:
        raise ConfigError("pipeline.memory_per_device: pipeline.plan=auto needs a memory budget per device, "
                          "e.g. pipeline.memory_per_device=8GiB")
    return PlannerConfig(plan, budget, devices, schedules, trials)

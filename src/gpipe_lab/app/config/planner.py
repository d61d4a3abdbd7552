"""``pipeline.plan=auto``: the app's planner keys, their defaults and their check.

The keys live in the ``pipeline`` group beside the engine's options but are the app's, not
``PipelineOptions`` fields (the engine knows nothing of planning). ``PlannerConfig`` is each key with
its one default and what it means; ``conf/pipeline/default.yaml`` lists the keys for Hydra with the
same values (``tests/planner/test_planner_config.py`` checks that they agree).

What ``auto`` compares with its budget, per stage: parameter state (parameters x bytes per
parameter of the optimizer, ``planner.search.bytes_per_param_of``) plus the peak saved-activation
bytes the engine tracks (``track_memory``, the ``SavedBytes`` rule); the run's ``summary.json``
records the same sum measured (parameter bytes from the stages, activations from the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpipe_lab.app.config.schema import ConfigError
from gpipe_lab.planner.plan_types import DEFAULT_TRIALS

__all__ = ["PLANNER_KEYS", "PLANS", "PlannerConfig", "engine_section", "validate_planner"]

PLANS = ("manual", "auto")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's keys, ``pipeline.<field>``, each with its one default; ``validate_planner``
    returns them checked, ``memory_per_device`` in bytes."""

    #: ``manual``: run the pipeline options as given; ``auto``: choose ``partitions``, ``balance``,
    #: ``chunks``, ``schedule``, ``checkpoint`` (and ``virtual_stages``) with ``planner.search`` for
    #: the budget, then run them (the other pipeline options stay as given).
    plan: str = "manual"
    #: the budget per device (needed by ``auto``): bytes, or a size such as ``8GiB``, ``512MiB``, ``1.5GB``.
    memory_per_device: int | str | None = None
    #: stages that can run side by side; ``None``: the GPUs, else the CPU cores (one thread per stage).
    devices_available: int | None = None
    #: the schedules ``auto`` searches; ``None``: ``planner.plan_types.DEFAULT_SCHEDULES``.
    schedules_allowed: tuple[str, ...] | None = None
    #: how many of the fastest predicted plans that fit ``auto`` runs for a few steps before choosing,
    #: the fastest measured winning (0: choose by the prediction alone).
    plan_trials: int = DEFAULT_TRIALS

    @property
    def auto(self) -> bool:
        return self.plan == "auto"

    @property
    def budget_bytes(self) -> int | None:
        """``memory_per_device`` in bytes (None: not given).

        Raises:
            ValueError: not a memory size (``planner.memory.parse_memory``).
        """
        from gpipe_lab.planner.memory import parse_memory

        m = self.memory_per_device
        return None if m is None else parse_memory(m, "pipeline.memory_per_device")


#: the planner's keys in the ``pipeline`` group (left out of ``PipelineOptions``)
PLANNER_KEYS = tuple(f.name for f in fields(PlannerConfig))


def engine_section(pipeline: Any) -> Any:
    """The ``pipeline`` group without the planner keys (what ``PipelineOptions`` is built from)."""
    if not isinstance(pipeline, DictConfig):
        return pipeline
    # resolved while attached: an interpolation into the rest of the config still resolves
    values = OmegaConf.to_container(pipeline, resolve=True)
    assert isinstance(values, dict)  # a DictConfig's container is a dict
    return OmegaConf.create({k: v for k, v in values.items() if k not in PLANNER_KEYS})


def validate_planner(cfg: DictConfig) -> PlannerConfig:
    """The planner keys of ``cfg.pipeline`` (see the module docstring).

    Raises:
        ConfigError: one line naming ``pipeline.<key>``, the value and what is allowed.
    """
    from gpipe_lab.pipeline.schedules import schedule_names

    section, default = cfg.pipeline, PlannerConfig()
    plan = section.get("plan", default.plan)
    if plan not in PLANS:
        raise ConfigError(f"pipeline.plan: must be one of {list(PLANS)}, got {plan!r}")
    try:
        budget = PlannerConfig(memory_per_device=section.get("memory_per_device", default.memory_per_device)
                               ).budget_bytes
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    devices = section.get("devices_available", default.devices_available)
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
        raise ConfigError(f"pipeline.devices_available: must be an integer >= 1 or null (GPUs, else CPU "
                          f"cores), got {devices!r}")
    schedules = section.get("schedules_allowed", default.schedules_allowed)
    if schedules is not None:
        names = list(schedules) if isinstance(schedules, (ListConfig, list, tuple)) else [schedules]
        if not names or any(n not in schedule_names() for n in names):
            raise ConfigError(f"pipeline.schedules_allowed: must be null or a non-empty list of "
                              f"{schedule_names()}, got {names!r}")
        schedules = tuple(names)
    trials = section.get("plan_trials", default.plan_trials)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 0:
        raise ConfigError(f"pipeline.plan_trials: must be an integer >= 0 (0: choose by the prediction alone), "
                          f"got {trials!r}")
    if plan == "auto" and budget is None:
        raise ConfigError("pipeline.memory_per_device: pipeline.plan=auto needs a memory budget per device, "
                          "e.g. pipeline.memory_per_device=8GiB")
    return PlannerConfig(plan, budget, devices, schedules, trials)

"""``gpipe-train pipeline.plan=auto``: plan before training, run the plan, record predicted beside measured.

``choose_plan`` runs the planner (``planner.search.plan_model``) on the run's model, mini-batch,
optimizer and budget (``app.config.planner``), prints the plan and returns the pipeline options that run
it. ``PlanRecord.compare`` puts the prediction beside the run's measured figures in the summary
(``summary.json`` and the wandb summary):

- ``predicted_step_s`` / ``measured_step_s``: the pipeline step (the timeline's wall time; mean over
  the steps the summary counts);
- ``predicted_bubble`` / ``measured_bubble``;
- ``predicted_stage_peak_bytes`` / ``measured_stage_peak_bytes`` (and their maxima
  ``predicted_peak_bytes`` / ``measured_peak_bytes``): per stage, parameter state (parameters x
  ``plan_bytes_per_param``) plus the peak saved-activation bytes, predicted by ``planner.memory``,
  measured by the engine's tracking (per device: a device's virtual stages summed); ``measured_within_budget`` compares the measured maximum with
  ``plan_memory_per_device_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from omegaconf import DictConfig

from gpipe_lab.app.config.planner import PlannerConfig
from gpipe_lab.app.config.schema import ConfigError
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.planner.plan_types import NoPlanFits, PlanResult
from gpipe_lab.planner.search import bytes_per_param_of, plan_model
from gpipe_lab.planner.trials import per_device

__all__ = ["PlanRecord", "choose_plan"]


@dataclass
class PlanRecord:
    """The plan a run chose and what it predicted (see the module docstring)."""

    result: PlanResult
    bytes_per_param: float
    facts: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The prediction's keys of the run's summary."""
        chosen = self.result.chosen
        return {"plan": "auto", "plan_chosen": chosen.candidate.describe(),
                "plan_memory_per_device_bytes": self.result.budget_bytes,
                "plan_bytes_per_param": self.bytes_per_param, "plan_profile_cached": self.facts.get("cached"),
                "plan_search_seconds": self.result.seconds,
                "predicted_step_s": chosen.step_time, "predicted_bubble": chosen.bubble,
                "predicted_stage_peak_bytes": [int(b) for b in chosen.stage_bytes],
                "predicted_peak_bytes": int(chosen.peak_bytes), "plan_trials": self.result.trials,
                "plan_trial_step_s": chosen.measured_step,
                "plan_runners_up": [r.to_dict() for r in self.result.runners_up]}

    def compare(self, summary: dict[str, Any], walls: list[float]) -> dict[str, Any]:
        """The measured figures beside the predicted ones, from the run's ``summary`` and the step
        walls the summary's means count."""
        params = summary.get("stage_parameter_bytes") or []
        acts = summary.get("stage_peak_activation_bytes") or []
        rows = [{"parameter_bytes": p, "peak_activation_bytes": a} for p, a in zip(params, acts)]
        devices = self.result.chosen.candidate.options.num_stages
        measured = [int(b) for b in per_device(rows, devices, self.bytes_per_param)] if rows else []
        peak = max(measured) if measured else None
        return {"measured_step_s": mean(walls) if walls else None,
                "measured_bubble": summary.get("bubble_measured"),
                "measured_stage_peak_bytes": measured, "measured_peak_bytes": peak,
                "measured_within_budget": None if peak is None else peak <= self.result.budget_bytes}


def choose_plan(cfg: DictConfig, options: PipelineOptions, planner: PlannerConfig,
                sizes: dict[str, Any]) -> tuple[PipelineOptions, PlanRecord]:
    """Plan the run's model (preset ``cfg.model.name`` with ``sizes``) at ``data.batch_size``; returns
    ``options`` with the chosen plan's fields (``plan_types.PLANNED``; ``cost`` ``params``, unused with a
    balance), and the record.

    Raises:
        ConfigError: no plan fits (naming the smallest memory that would and its plan), no
            ``data.batch_size``, or an optimizer the planner does not know.
    """
    batch = cfg.data.get("batch_size")
    if not isinstance(batch, int):
        raise ConfigError(f"pipeline.plan=auto: plans for data.batch_size, which is {batch!r}")
    try:
        bpp = bytes_per_param_of(cfg.optimizer.get("name"), cfg.optimizer.get("momentum"))
        budget = planner.budget_bytes
        assert budget is not None  # validate_planner requires it with auto
        result, _, facts = plan_model(cfg.model.name, sizes, batch, budget, planner.devices_available,
                                      planner.schedules_allowed, bytes_per_param=bpp, trials=planner.plan_trials)
    except NoPlanFits as exc:
        raise ConfigError(f"pipeline.memory_per_device: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"pipeline.plan=auto: {exc}") from None
    print(result.describe(f"pipeline.plan=auto ({cfg.model.name})", facts))
    return result.chosen.candidate.applied_to(options).replace(cost="params"), PlanRecord(result, bpp, facts)

"""What flows through the planner's steps: a candidate plan, a scored plan, the search's result (and its
text), the refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpipe_lab.pipeline import PipelineOptions
from gpipe_lab.planner.memory import format_bytes

__all__ = ["BYTES_PER_PARAM", "CHECKPOINTS", "DEFAULT_SCHEDULES", "DEFAULT_TRIALS", "MAX_MICROBATCHES", "PLANNED",
           "RUNNERS_UP", "VIRTUAL_STAGES", "Candidate", "NoPlanFits", "PlanResult", "Scored"]

# The search's defaults, each written here only (``gpipe-plan auto``'s flags, ``search.plan_model`` and
# the app's ``pipeline.*`` planner keys read them).
#: schedules searched; ``interleaved-1f1b`` with ``VIRTUAL_STAGES`` per device (with one it is ``1f1b``)
DEFAULT_SCHEDULES = ("gpipe", "gpipe-bw", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
#: virtual stages per device searched for ``interleaved-1f1b`` (K >= 2, K·v <= the layers)
VIRTUAL_STAGES = (2, 4)
#: checkpoint modes searched, from the simplest (a tie goes to the earlier)
CHECKPOINTS = ("never", "except_last", "always")
#: M is searched over 1, 2, 4, ... up to this (and the mini-batch)
MAX_MICROBATCHES = 32
#: parameter state bytes per parameter: Adam in float32 (weights, gradients, two slots)
BYTES_PER_PARAM = 16.0
#: plans ``gpipe-plan auto`` and ``pipeline.plan=auto`` run before choosing (``planner.trials``; 0: the
#: prediction alone)
DEFAULT_TRIALS = 3
#: runner-ups listed beside the chosen plan (the fastest that fit; the neighbours over memory come on top)
RUNNERS_UP = 5
#: the pipeline options a plan decides; a run's other options stay as given
PLANNED = ("partitions", "balance", "chunks", "schedule", "checkpoint", "virtual_stages")


@dataclass(frozen=True)
class Candidate:
    """One plan: the ``PipelineOptions`` that run it (the ``PLANNED`` fields set, the others at their
    defaults). K = ``partitions`` devices hold ``balance``'s stages of layers (K·v stages with v
    ``virtual_stages`` per device: stage s on device ``s % K``), M = ``chunks`` micro-batches."""

    options: PipelineOptions

    def __hash__(self) -> int:  # the options are mutable; a plan is its description
        return hash(self.describe())

    def describe(self) -> str:
        """One line: K, M, balance, schedule (and virtual stages) and checkpoint mode."""
        o = self.options
        v = f" virtual_stages={o.virtual_stages}" if o.virtual_stages > 1 else ""
        return (f"K={o.partitions} M={o.chunks} balance={o.balance} "
                f"schedule={o.schedule}{v} checkpoint={o.checkpoint}")

    def applied_to(self, options: PipelineOptions) -> PipelineOptions:
        """``options`` with this plan's ``PLANNED`` fields."""
        return options.replace(**{name: getattr(self.options, name) for name in PLANNED})


@dataclass
class Scored:
    """A candidate with its per-stage peak memory (bytes) and, if simulated, its predicted step; if
    trialled (``planner.trials``), its measured step and per-stage memory."""

    candidate: Candidate
    stage_bytes: list[float]
    step_time: float | None = None
    bubble: float | None = None
    reason: str = ""
    measured_step: float | None = None
    measured_stage_bytes: list[float] | None = None

    @property
    def peak_bytes(self) -> float:
        return max(self.stage_bytes)

    def to_dict(self) -> dict[str, object]:
        o = self.candidate.options
        return {"K": o.partitions, "M": o.chunks, "balance": list(o.balance or []), "schedule": o.schedule,
                "virtual_stages": o.virtual_stages,
                "checkpoint": o.checkpoint, "step_time_s": self.step_time, "bubble": self.bubble,
                "stage_peak_bytes": [int(b) for b in self.stage_bytes], "reason": self.reason,
                "measured_step_s": self.measured_step,
                "measured_stage_peak_bytes": None if self.measured_stage_bytes is None
                else [int(b) for b in self.measured_stage_bytes]}


@dataclass
class PlanResult:
    """The chosen plan, the runner-ups (with reasons) and what the search did."""

    chosen: Scored
    runners_up: list[Scored]
    budget_bytes: int
    batch: int
    devices: int
    considered: int
    fitting: int
    simulated: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    trials: int = 0  # plans run before choosing (``planner.trials``); 0: chosen by prediction alone

    @property
    def samples_per_s(self) -> float:
        assert self.chosen.step_time is not None
        return self.batch / self.chosen.step_time

    def to_dict(self) -> dict[str, object]:
        return {"chosen": self.chosen.to_dict(), "runners_up": [r.to_dict() for r in self.runners_up],
                "budget_bytes": self.budget_bytes, "batch": self.batch, "devices": self.devices,
                "considered": self.considered, "fitting": self.fitting, "simulated": self.simulated, "search_seconds": self.seconds,
                "trials": self.trials, "notes": list(self.notes)}

    def describe(self, title: str, facts: dict[str, Any] | None = None) -> str:
        """The plan as ``gpipe-plan auto`` and ``pipeline.plan=auto`` print it: the chosen plan, its
        predicted step, bubble and memory per stage, and the runner-ups with the reason each lost;
        ``facts`` (from ``search.plan_model``) say where the profile came from and what the trials took."""
        c, chosen = self.chosen.candidate, self.chosen
        assert chosen.step_time is not None and chosen.bubble is not None  # the chosen plan was simulated
        facts = facts or {}
        profile = ("profile from the cache" if facts.get("cached")
                   else f"profile measured in {facts.get('profile_seconds', 0.0):.1f} s")
        if self.trials:
            profile += f"; {self.trials} plans trialled in {facts.get('trial_seconds', 0.0):.1f} s"
        lines = [f"{title}: batch {self.batch}, {self.devices} devices, {format_bytes(self.budget_bytes)} per "
                 f"device ({profile}; search: {self.considered} plans, {self.fitting} fit, {self.simulated} "
                 f"simulated in full, {self.seconds:.2f} s)",
                 f"chosen: {c.describe()}" + (f" ({chosen.reason.removeprefix('chosen: ')})" if self.trials else ""),
                 f"  predicted step {chosen.step_time * 1e3:.1f} ms ({self.samples_per_s:,.0f} samples/s), "
                 f"bubble {chosen.bubble:.3f}" + _measured(chosen),
                 "  stage  peak memory  (budget " + format_bytes(self.budget_bytes) + ")"]
        lines += [f"  {k:>5}  {format_bytes(b):>11}" for k, b in enumerate(chosen.stage_bytes)]
        lines.append("runner-ups:")
        for r in self.runners_up:
            step = f"{r.step_time * 1e3:.1f} ms" if r.step_time is not None else "not simulated"
            lines.append(f"  {r.candidate.describe()}  [{step}{_measured(r)}, peak {format_bytes(r.peak_bytes)}]: "
                         f"{r.reason}")
        if not self.runners_up:
            lines.append("  (none: no other plan fits)")
        return "\n".join(lines)


def _measured(s: Scored) -> str:
    return "" if s.measured_step is None else f", measured {s.measured_step * 1e3:.1f} ms in trial"


class NoPlanFits(ValueError):
    """No candidate fits the budget; ``smallest`` is the plan that fits the least memory (its peak:
    ``smallest.peak_bytes``)."""

    def __init__(self, message: str, smallest: Scored) -> None:
        super().__init__(message)
        self.smallest = smallest

"""What the planner's search handles: a candidate plan, a scored plan, the search's result, the refusal."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEFAULT_TRIALS", "Candidate", "NoPlanFits", "PlanResult", "Scored"]

#: plans ``gpipe-plan auto`` and ``pipeline.plan=auto`` run before choosing (``planner.trials``; 0: the
#: prediction alone)
DEFAULT_TRIALS = 3


@dataclass(frozen=True)
class Candidate:
    """One plan: K devices holding ``balance``'s stages of layers (K·v stages with v virtual stages per
    device: stage s on device ``s % K``), M micro-batches, a schedule and a checkpoint mode."""

    balance: tuple[int, ...]
    microbatches: int
    schedule: str
    checkpoint: str
    virtual_stages: int = 1

    @property
    def partitions(self) -> int:
        """K: the devices (pipeline ranks)."""
        return len(self.balance) // self.virtual_stages

    def describe(self) -> str:
        v = f" virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"K={self.partitions} M={self.microbatches} balance={list(self.balance)} "
                f"schedule={self.schedule}{v} checkpoint={self.checkpoint}")


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
        c = self.candidate
        return {"K": c.partitions, "M": c.microbatches, "balance": list(c.balance), "schedule": c.schedule,
                "virtual_stages": c.virtual_stages,
                "checkpoint": c.checkpoint, "step_time_s": self.step_time, "bubble": self.bubble,
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


class NoPlanFits(ValueError):
    """No candidate fits the budget; ``smallest`` is the plan that fits the least memory (its peak:
    ``smallest.peak_bytes``)."""

    def __init__(self, message: str, smallest: Scored) -> None:
        super().__init__(message)
        self.smallest = smallest

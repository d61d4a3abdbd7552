"""What each stage did and when: events, busy time and the measured bubble."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# F forward, B backward (input and, unless split, weight gradients), W deferred
# weight gradients, R recompute of a checkpointed micro-batch, wait: time spent
# blocked on a neighbour's activation or gradient.
COMPUTE_KINDS = ("F", "B", "W", "R")


@dataclass(frozen=True)
class Event:
    """One action of one stage: times are ``time.perf_counter()`` seconds."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The events of one step, with its wall-clock start and end."""

    num_stages: int
    start: float = 0.0
    end: float = 0.0
    events: list[Event] = field(default_factory=list)
    #: M the step actually ran (min(chunks, batch)); 0 for timelines not measured by an engine
    num_microbatches: int = 0
    #: GPU steps: returns the actions timed with CUDA events (see ``on_device``)
    device_source: Callable[[], list[Event]] | None = field(default=None, repr=False, compare=False)

    def on_device(self) -> Timeline:
        """The same step with GPU stages' actions timed by CUDA events, not host times.

        On a GPU the host times bracket kernel launches only; this waits for the
        device once and returns the actions as the device ran them. A GPU stage
        keeps no host event: its host ``wait`` events measure when the host thread
        blocked, not when the device idled, so on the device timeline a GPU stage's
        idle time is the gaps between its actions (``waiting()`` counts none for
        it). CPU stages keep their host events, waits included. Without GPU
        stages, the timeline itself.
        """
        if self.device_source is None:
            return self
        device = self.device_source()
        if not device:
            return self
        on_gpu = {e.stage for e in device}
        events = sorted([e for e in self.events if e.stage not in on_gpu] + device, key=lambda e: e.start)
        end = max([self.end] + [e.end for e in events])
        return Timeline(self.num_stages, self.start, end, events, self.num_microbatches)

    @property
    def wall(self) -> float:
        return self.end - self.start

    def busy(self) -> list[float]:
        """Seconds each stage spent computing (F, B, W and recompute)."""
        totals = [0.0] * self.num_stages
        for e in self.events:
            if e.kind in COMPUTE_KINDS:
                totals[e.stage] += e.duration
        return totals

    def waiting(self) -> list[float]:
        """Seconds each stage spent blocked on a neighbour."""
        totals = [0.0] * self.num_stages
        for e in self.events:
            if e.kind == "wait":
                totals[e.stage] += e.duration
        return totals

    def time_in(self, kind: str) -> float:
        """Total seconds over all stages spent in actions of one kind."""
        return sum(e.duration for e in self.events if e.kind == kind)

    def measured_bubble(self) -> float:
        """1 - busy / (K · wall): the idle share of the stages over the step."""
        if self.wall <= 0:
            return 0.0
        return 1.0 - sum(self.busy()) / (self.num_stages * self.wall)

    def shifted(self) -> list[Event]:
        """Events with times relative to the step start."""
        return [Event(e.stage, e.kind, e.microbatch, e.start - self.start, e.end - self.start)
                for e in self.events]

    def to_dict(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages, "wall": self.wall,
                "events": [asdict(e) for e in self.shifted()]}

    @classmethod
    def merge(cls, timelines: list[Timeline]) -> Timeline:
        """Join per-rank timelines (one stage each) into one; clocks must be comparable."""
        merged = cls(max(t.num_stages for t in timelines),
                     min(t.start for t in timelines), max(t.end for t in timelines))
        for t in timelines:
            merged.events.extend(t.events)
        merged.events.sort(key=lambda e: (e.start, e.stage))
        return merged

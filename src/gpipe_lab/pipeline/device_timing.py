"""Device-side timing of a stage's actions: CUDA events, resolved to seconds once, when read.

On a GPU the host times around an action only bracket its kernel launches. A
``DeviceClock`` records a CUDA event (on the thread's current stream: the
stage's compute stream) at each action's start and end, and one origin event
with its host time when the step begins. Nothing is read during the step:
``resolve`` (called when someone asks for the device timeline) waits for the
last event and turns each pair into host-clock seconds from the origin, so the
events of all stages of a device share one clock.
"""

from __future__ import annotations

import time

import torch

from gpipe_lab.pipeline.timeline import Event


class DeviceClock:
    """CUDA events around one stage's actions (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.origin: torch.cuda.Event | None = None
        self.origin_host = 0.0
        self.marks: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event, int, int]] = []

    def begin(self) -> None:
        """Mark the step's start on the calling thread's stream (before the stages start)."""
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record(torch.cuda.current_stream(self.device))
        self.origin_host = time.perf_counter()
        self.marks = []

    def start(self) -> torch.cuda.Event:
        """An event at an action's start, on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, kind: str, microbatches: tuple[int, ...], start: torch.cuda.Event) -> None:
        """Close an action (a W run covers several micro-batches, each given an equal share)."""
        end = self.start()
        for i, mb in enumerate(microbatches):
            self.marks.append((kind, mb, start, end, i, len(microbatches)))

    def resolve(self, stage: int) -> list[Event]:
        """The actions as events in host-clock seconds (waits for the device once)."""
        if self.origin is None or not self.marks:
            return []
        self.marks[-1][3].synchronize()
        out = []
        for kind, mb, start, end, i, n in self.marks:
            t0 = self.origin_host + self.origin.elapsed_time(start) / 1e3
            t1 = self.origin_host + self.origin.elapsed_time(end) / 1e3
            out.append(Event(stage, kind, mb, t0 + (t1 - t0) * i / n, t0 + (t1 - t0) * (i + 1) / n))
        return out

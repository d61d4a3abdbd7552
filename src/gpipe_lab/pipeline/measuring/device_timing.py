"""Device-side timing of a stage's actions: CUDA events, resolved to seconds once, when read.

On a GPU the host times around an action only bracket its kernel launches. A
``DeviceClock`` records a CUDA event (on the thread's current stream: the
stage's compute stream) at each action's start and end. Nothing is read
during the step.

Device events carry no host time, only the time between them, so the clock is
anchored when it is read: ``resolve`` waits for the step's events, records one
more event on an idle stream of its own, waits for it and reads the host clock
around that wait. An event on an idle stream runs as soon as it is queued, so
its host time is known to within that one round trip, whereas the host time
at which an event is *queued* can precede the moment it *runs* by everything
already queued ahead of it (the previous step's work, the launches ahead). Every action is then
placed at ``anchor_host - (anchor - action)`` on the host clock, so the events
of all stages of a device share one clock with the host's.
"""

from __future__ import annotations

import time

import torch

from gpipe_lab.pipeline.measuring.step_timeline import Event


class DeviceClock:
    """CUDA events around one stage's actions (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event, int, int]] = []
        self._anchor_stream: torch.cuda.Stream | None = None  # made once, on first read

    def begin(self) -> None:
        """Forget the previous step's actions (before the stages start)."""
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

    def anchor(self) -> tuple[torch.cuda.Event, float]:
        """An event that has run, and the host time at which it ran (the middle of its round trip)."""
        if self._anchor_stream is None:
            self._anchor_stream = torch.cuda.Stream(self.device)
        event = torch.cuda.Event(enable_timing=True)
        before = time.perf_counter()
        event.record(self._anchor_stream)
        event.synchronize()
        return event, (before + time.perf_counter()) / 2

    def resolve(self, stage: int) -> list[Event]:
        """The actions as events in host-clock seconds (waits for the device once)."""
        if not self.marks:
            return []
        for mark in self.marks:  # every end event (on the stage's stream) must have run
            mark[3].synchronize()
        anchor, anchor_host = self.anchor()

        def host(event: torch.cuda.Event) -> float:
            return anchor_host - float(event.elapsed_time(anchor)) / 1e3  # (torch leaves it unannotated)

        out = []
        for kind, mb, start, end, i, n in self.marks:
            t0, t1 = host(start), host(end)
            out.append(Event(stage, kind, mb, t0 + (t1 - t0) * i / n, t0 + (t1 - t0) * (i + 1) / n))
        return out

"""``local_stages="auto"``: the first training steps try both ways, the faster one stays.

Threads and stage processes give the same results bit for bit, so the steps of the trial
are ordinary training steps: one warm-up step each way (the processes' start, the first
step's probes), then ``ROUNDS`` timed steps each way, alternating; the way with the lower
median step time runs every later step (processes only when strictly faster). Which is
faster depends on the machine, the layers and the micro-batch size (README, "Stage
processes"), so it is measured where the pipe runs rather than guessed.
"""

from __future__ import annotations

import statistics

#: timed training steps of each way after the warm-up
ROUNDS = 3
WAYS = ("processes", "threads")


class AutoTrial:
    """The trial's order of steps and its verdict."""

    def __init__(self, rounds: int = ROUNDS) -> None:
        self.order = list(WAYS) + list(WAYS) * rounds  # warm-up, then alternating timed steps
        self.times: dict[str, list[float]] = {way: [] for way in WAYS}
        self.done = 0
        self.choice: str | None = None

    def next_way(self) -> str:
        """The way the next training step runs."""
        return self.choice or self.order[self.done]

    def record(self, way: str, seconds: float) -> str | None:
        """A finished training step of ``way``; returns the choice once the trial has ended."""
        if self.choice is not None:
            return self.choice
        if self.done >= len(WAYS):  # past the warm-up
            self.times[way].append(seconds)
        self.done += 1
        if self.done == len(self.order):
            medians = {w: statistics.median(t) for w, t in self.times.items()}
            self.choice = "processes" if medians["processes"] < medians["threads"] else "threads"
        return self.choice

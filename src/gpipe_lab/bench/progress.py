"""Progress of long experiment and benchmark runs: a line per finished job, with the time left.

    progress = Progress(12, "table2_throughput")
    for job in jobs:
        run(job)
        progress.done(f"amoebanet K=2 M=4")
    # [table2_throughput] 3/12 amoebanet K=2 M=4: 12.1 s; 40 s so far, about 2 min 0 s left

The estimate is the mean time of the finished jobs times the jobs left: rough where jobs
differ in size, and it improves as they finish. Lines go to stderr, so stdout keeps the
script's own output.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s`` or ``1 h 2 min``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Progress:
    """Counts finished jobs out of ``total`` and prints a line for each (see the module docstring)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, note: str = "") -> None:
        """Print the opening line (``total`` jobs, ``note``).

        Raises:
            ValueError: ``total`` below 0.
        """
        if total < 0:
            raise ValueError(f"a run has 0 or more jobs, got total={total}")
        self.total, self.label, self.finished = total, label, 0
        self._stream, self._clock = stream, clock
        self._start = self._last = clock()
        self._print(f"[{label}] {total} job{'s' * (total != 1)}{'; ' + note if note else ''}")

    def _print(self, line: str) -> None:
        print(line, file=self._stream if self._stream is not None else sys.stderr, flush=True)

    def done(self, what: str) -> str:
        """One more job finished (``what`` names it); prints and returns its line."""
        now = self._clock()
        self.finished += 1
        took, self._last = now - self._last, now
        elapsed = now - self._start
        left = max(0, self.total - self.finished)
        estimate = f"about {duration(elapsed / self.finished * left)} left" if left else "done"
        line = (f"[{self.label}] {self.finished}/{self.total} {what}: {took:.1f} s; "
                f"{duration(elapsed)} so far, {estimate}")
        self._print(line)
        return line

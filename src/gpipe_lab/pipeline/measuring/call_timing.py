"""The one call timer (the planner's trials, the benchmarks, the experiments): functions timed in
alternating rounds after warm-up.

Every round calls each function once, in the given order on even rounds and in
reverse on odd ones, so that a drift of the machine's speed during the run hits
all contenders alike and their ratios stay meaningful. ``between`` (zeroing
gradients, a barrier) runs before every call, outside the timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Seconds of each measured call of one function, in call order."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        """Median seconds per call."""
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        """Fastest call, seconds."""
        return min(self.times)

    @property
    def max(self) -> float:
        """Slowest call, seconds."""
        return max(self.times)

    def summary(self) -> dict[str, float]:
        """``{"median", "min", "max", "n"}``, the form the benchmark JSON keeps."""
        return {"median": self.median, "min": self.min, "max": self.max, "n": len(self.times)}


def time_rounds(fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 0,
                between: Callable[[], object] | None = None) -> dict[str, Timing]:
    """Time every function of ``fns`` once per round, ``warmup`` unmeasured rounds then ``repeats`` measured.

    Raises:
        ValueError: no function, ``repeats`` below 1 or ``warmup`` below 0.
    """
    if not fns:
        raise ValueError("time_rounds needs at least one function to time")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            if between is not None:
                between()
            start = time.perf_counter()
            fns[name]()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    return {name: Timing(tuple(values)) for name, values in times.items()}


def paired_ratio(a: Timing, b: Timing) -> float:
    """Median over rounds of ``a``'s call / ``b``'s call in the same round (``time_rounds``' timings).

    Both calls of a round ran back to back, so a slow moment of the machine (another process, a
    frequency change) hits both and cancels in their ratio; the ratio of medians keeps it.

    Raises:
        ValueError: timings of different lengths (not from the same rounds) or empty ones.
    """
    if len(a.times) != len(b.times) or not a.times:
        raise ValueError(f"paired_ratio needs the same rounds of both, got {len(a.times)} and {len(b.times)} calls")
    return statistics.median(x / y for x, y in zip(a.times, b.times))


def time_call(fn: Callable[[], object], repeats: int, warmup: int = 0,
              between: Callable[[], object] | None = None) -> Timing:
    """``time_rounds`` of one function.

    Raises:
        ValueError: ``repeats`` below 1 or ``warmup`` below 0.
    """
    return time_rounds({"fn": fn}, repeats, warmup, between)["fn"]

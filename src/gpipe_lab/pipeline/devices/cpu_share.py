"""How many intra-op threads a CPU stage gets: the cores this process may use, less what others use.

An OpenMP team that does not own its cores collapses: a parallel region ends at a barrier that
waits for whichever team thread the kernel has descheduled, and idle team threads spin. Measured
on a 2-core machine (``python -m benchmarks.probes.shared_machine_threads``), the default model at
K=1, M=4 beside one busy process took 5x as long per step with two threads as with one, beside
two busy processes 30x. So the default gives each CPU stage an equal share of the *free* cores:

- ``usable_cores()``: the cores this process may run on (its affinity mask, not the machine's);
- ``busy_elsewhere()``: the cores' worth of CPU time other processes used over a short sample of
  ``/proc/stat`` (on this process's cores, this process's own time taken out); 0 where there is no
  ``/proc/stat``;
- ``free_cores``/``default_threads``: the pure choice (tests inject the two values);
- ``warn_if_oversubscribed``: one log line, once per process, when stages x threads exceed the
  usable cores (e.g. four processes of one thread each on two cores), or stages of several
  threads exceed the free ones.

The choice is made when a pipeline is built; a load that starts later is not seen.
"""

from __future__ import annotations

import logging
import os
import threading
import time

SAMPLE_S = 0.1  # long enough for 10 clock ticks per core at 100 Hz
REUSE_S = 5.0  # pipelines built in quick succession (a sweep, a test module) share one sample

log = logging.getLogger(__name__)
_lock = threading.Lock()
_samples: dict[frozenset[int], tuple[float, float]] = {}  # cores -> (monotonic time taken, busy elsewhere)
_warned = False


def usable_cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` without it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_jiffies(cpus: frozenset[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks of ``cpus`` since boot, from ``/proc/stat``; None without it."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def busy_elsewhere(sample_s: float = SAMPLE_S) -> float:
    """Cores' worth of CPU that other processes used on this process's cores over ``sample_s``.

    A sample of the same cores taken less than ``REUSE_S`` seconds ago is reused. 0.0 where
    ``/proc/stat`` is missing.
    """
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = frozenset(range(os.cpu_count() or 1))
    with _lock:
        taken = _samples.get(cpus)
        if taken is not None and time.monotonic() - taken[0] < REUSE_S:
            return taken[1]
        before, own_before, start = _cpu_jiffies(cpus), _own_cpu_s(), time.monotonic()
        if before is None:
            return 0.0
        time.sleep(sample_s)
        after, own_after, wall = _cpu_jiffies(cpus), _own_cpu_s(), time.monotonic() - start
        if after is None or after[1] <= before[1]:
            return 0.0
        others_s = (after[0] - before[0]) / os.sysconf("SC_CLK_TCK") - (own_after - own_before)
        busy = max(0.0, min(float(len(cpus)), others_s / wall))
        _samples[cpus] = (time.monotonic(), busy)
        return busy


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def free_cores(cores: int, busy: float) -> int:
    """The cores left by ``busy`` cores' worth of others' work (rounded, at least 1)."""
    return max(1, min(cores, int(cores - busy + 0.5)))


def default_threads(stages: int, cores: int | None = None, busy: float | None = None) -> int:
    """Intra-op threads for each of ``stages`` CPU stages of this process: an equal share of the
    free cores, at least 1. ``cores``/``busy`` default to ``usable_cores()``/``busy_elsewhere()``
    (no sample is taken where the answer is 1 whatever the load).

    Raises:
        ValueError: ``stages`` < 1.
    """
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    cores = usable_cores() if cores is None else cores
    if cores // stages <= 1:
        return 1
    return max(1, free_cores(cores, busy_elsewhere() if busy is None else busy) // stages)


def oversubscription(stages: int, threads: int, cores: int | None = None,
                     busy: float | None = None) -> str | None:
    """The one-line warning when ``stages`` x ``threads`` exceed the cores this process may use,
    or, for stages of several threads (OpenMP teams, which collapse without their cores), the
    free cores; else None. Single-threaded stages beside other work only share the cores, so
    the load alone does not warn: a run's output does not change with its neighbours.

    ``stages`` counts this machine's CPU stages (a distributed run's processes on this node).
    """
    cores = usable_cores() if cores is None else cores
    if stages * threads > cores:
        free, why = cores, f"{cores} core(s) this process may use"
    elif threads > 1:
        busy = busy_elsewhere() if busy is None else busy
        free = free_cores(cores, busy)
        if stages * threads <= free:
            return None
        why = f"{free} free core(s) ({cores} usable, {busy:.1f} busy elsewhere)"
    else:
        return None
    return (f"{stages} CPU stage(s) x {threads} intra-op thread(s) exceed the {why}: stages will wait "
            f"for cores and steps run slower than on a machine of their own; fewer stages or processes, "
            f"or fewer threads_per_stage, fit better")


def warn_if_oversubscribed(stages: int, threads: int) -> None:
    """Log ``oversubscription(stages, threads)`` as a warning, once per process."""
    global _warned
    if _warned:
        return
    message = oversubscription(stages, threads)
    if message is not None:
        _warned = True
        log.warning(message)

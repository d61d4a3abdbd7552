"""A grid of throughput cells (K x M) for Tables 2 and 3: measured, emulated and simulated.

``run_grid`` measures the cells it can (CPU stages, or GPUs with ``--gpu``), fits one
``CostModel`` per workload (``throughput_lib.timed_cost_model``) and simulates every cell;
``run_grids`` runs each config's grid and reports every job to one ``Progress``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from typing import Any

from omegaconf import DictConfig

from experiments.throughput_lib import (
    emulated_cost_model,
    emulation_settings,
    engine_overhead,
    error,
    hop_seconds,
    timed_cost_model,
    uncontended,
)
from gpipe_lab.app.config.experiments import workload_of
from gpipe_lab.bench import EmulatedSpec, Progress
from gpipe_lab.bench.step_timing import gpu_devices, measure_step
from gpipe_lab.pipeline import Timeline
from gpipe_lab.planner.workload import WorkloadSpec


def run_grids(cfgs: Iterable[DictConfig], label: str, gpu: bool = False, note: str = ""
              ) -> Iterator[tuple[Any, WorkloadSpec, list[dict]]]:
    """``run_grid`` of each config's ``experiment`` block, one ``Progress`` over all their jobs.

    Yields ``(experiment block, workload, rows)`` per config.
    """
    cfgs = list(cfgs)
    blocks = [c.experiment for c in cfgs]
    progress = Progress(sum(grid_jobs(list(e.measured_k), list(e.simulated_k), list(e.chunks), gpu,
                                      emulation_settings(e)[0]) for e in blocks), label, note=note)
    for e in blocks:
        work = workload_of(e)
        emulated_k, emulated_ms = emulation_settings(e)
        grid = run_grid(work, list(e.measured_k), list(e.simulated_k), list(e.chunks), e.steps, e.repeat, gpu,
                        emulated_k, emulated_ms, progress)
        yield e, work, grid


def grid_jobs(measured_k: list[int], simulated_k: list[int], chunks: list[int], gpu: bool = False,
              emulated_k: list[int] | None = None) -> int:
    """How many jobs ``run_grid`` reports to its ``progress``: measured and emulated cells, and the fit."""
    all_k = set(measured_k) | set(simulated_k)
    measured = sum(k in measured_k or bool(gpu and gpu_devices(k)) for k in all_k)
    return len(chunks) * (measured + len(set(emulated_k or []))) + 1


def run_grid(work: WorkloadSpec, measured_k: list[int], simulated_k: list[int], chunks: list[int],
             steps: int = 3, repeat: int = 3, gpu: bool = False, emulated_k: list[int] | None = None,
             emulated_ms: float = 0.0, progress: Progress | None = None) -> list[dict]:
    """Measure (K in ``measured_k``), measure on emulated devices (K in ``emulated_k``, their mini-batch
    forward taking ``emulated_ms``) and simulate (every K) each M.

    Timed once, simulated many: per-layer times at every micro-batch size of the grid (and at 8x the
    micro-batch when the grid has one M: fixed + per-sample needs two sizes), alone and beside a
    second stage (when the grid has K >= 2), the engine's
    per-action overhead and the median hand-over of the measured K >= 2 steps are measured once; the
    cost model fitted from them predicts every cell. With ``gpu`` every K this machine has GPUs for is
    measured on ``cuda:0..K-1``.

    Returns one row per (K, M): measured / emulated / simulated seconds and samples/s (None where not
    run), the simulator's error against each, bubbles, the balance and the timelines. ``progress`` is told
    of each of the ``grid_jobs`` jobs as it finishes.
    """
    model = work.model()
    emulated_k = list(emulated_k or [])
    fit_chunks = set(chunks) if len(set(chunks)) > 1 else {*chunks, max(1, min(chunks) // 8)}
    sizes = [work.batch // m for m in sorted(fit_chunks)]
    all_k = set(measured_k) | set(simulated_k)
    real: dict[tuple[int, int], tuple[float, Timeline, list[int]]] = {}
    for m in chunks:
        for k in sorted(all_k):
            devices = gpu_devices(k) if gpu else None
            if k in measured_k or devices:
                real[(k, m)] = measure_step(work, k, m, steps, devices=devices)
                if progress is not None:
                    progress.done(f"{work.name} measured K={k} M={m}")
    hops = [hop_seconds(tl) for (k, _), (_, tl, _) in real.items() if k > 1]
    cost = timed_cost_model(work, sizes, repeat, engine_overhead(), statistics.median(hops) if hops else 0.0,
                            contended=max(all_k, default=1) > 1)
    if progress is not None:
        progress.done(f"{work.name} per-layer times for the simulator")
    emu = EmulatedSpec(work, emulated_ms) if emulated_k else None
    rows = []
    for m in chunks:
        for k in sorted(all_k | set(emulated_k)):
            measured, timeline, balance = real.get((k, m), (None, None, work.balance(model, k)))
            pred = cost.predict(balance, m, work.batch)
            alone = uncontended(cost).predict(balance, m, work.batch).step_time
            row = {"workload": work.name, "K": k, "M": m, "batch": work.batch, "balance": balance,
                   "measured_s": measured, "simulated_s": pred.step_time, "hop_s": cost.handover,
                   "simulated_alone_s": alone, "sim_alone_error": error(alone, measured),
                   "overhead_s": cost.action_overhead, "sim_error": error(pred.step_time, measured),
                   "measured_sps": None if measured is None else work.batch / measured,
                   "simulated_sps": work.batch / pred.step_time,
                   "measured_bubble": None if timeline is None else timeline.measured_bubble(),
                   "simulated_bubble": pred.bubble, "timeline": timeline, "sim_timeline": pred.timeline,
                   "emulated_s": None, "emulated_sps": None, "emulated_sim_s": None, "emulated_error": None,
                   "emulated_bubble": None}
            if emu is not None and k in emulated_k:
                row.update(emulated_cell(emu, k, m, steps))
                if progress is not None:
                    progress.done(f"{work.name} emulated K={k} M={m}")
            rows.append(row)
    return rows


def emulated_cell(emu: EmulatedSpec, partitions: int, chunks: int, steps: int) -> dict[str, float | None]:
    """One (K, M) step on emulated devices: seconds, samples/s, bubble, and the simulator's prediction
    from the devices' exact costs (the difference is the engine's hand-over and scheduling cost)."""
    seconds, timeline, balance = measure_step(emu, partitions, chunks, steps)
    pred = emulated_cost_model(emu).predict(balance, chunks, emu.batch)
    return {"emulated_s": seconds, "emulated_sps": emu.batch / seconds, "emulated_sim_s": pred.step_time,
            "emulated_error": error(pred.step_time, seconds), "emulated_bubble": timeline.measured_bubble()}

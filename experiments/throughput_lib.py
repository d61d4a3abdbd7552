"""Measuring pipeline steps (CPU stages or emulated devices) and per-layer times for the simulator.

``measure_step`` runs ``GPipe`` (one thread per stage) for a few steps, timed by
``gpipe_lab.bench``'s timer, and keeps the median step time and the timeline of
the median step; given an ``EmulatedSpec`` its stages sleep instead of computing.
``run_grid`` fits the planner's ``CostModel`` (fixed + per-sample per layer, alone
and beside a second busy stage, from ``layer_timing.layer_times``; engine overhead
per action; hand-over per hop) once and predicts every cell of a grid with it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from typing import Any

import torch
from omegaconf import DictConfig

from experiments.layer_timing import layer_times
from gpipe_lab.bench import EmulatedSpec, Progress, Timing, WorkloadSpec, time_call
from gpipe_lab.pipeline import GPipe, Timeline
from gpipe_lab.planner.cost_model import CostModel, LinearCost
from gpipe_lab.planner.simulator import costs_from_timeline

#: How the simulated cells are made, for the tables' descriptions (one text for every table).
SIMULATOR_TEXT = (
    "*Simulated*: the planner's simulator with a cost model fitted once per workload: every layer's "
    "forward (inside the random-replay hop, as a stage runs it), replayed forward and backward timed at "
    "each micro-batch size, one thread, fitted as fixed + per-sample between neighbouring sizes; timed once "
    "alone and once beside a second thread running the same pass, and each action of a multi-stage step "
    "costs between the two by the share of it another stage computes (`planner/contention.py`); plus "
    "the engine's per-action overhead and the measured hand-over.")


def gpu_devices(partitions: int) -> list[str] | None:
    """``cuda:0..K-1`` when this machine has K GPUs, else None (CPU stages)."""
    return [f"cuda:{i}" for i in range(partitions)] if torch.cuda.device_count() >= partitions else None


def measure_step(work: WorkloadSpec, partitions: int, chunks: int, steps: int = 3,
                 checkpoint: str = "except_last", devices: list[str] | None = None,
                 ) -> tuple[float, Timeline, list[int]]:
    """Median seconds per training step of GPipe, the median step's timeline, the balance.

    CPU stages (one thread each) unless ``devices`` (e.g. ``gpu_devices(K)``; not
    exercised on the CPU-only machine these results were made on). With
    ``partitions=1`` on CPU this is the single-stage run on one thread.
    """
    built = work.build(partitions)
    y = built.targets.to(devices[-1]) if devices else built.targets  # the last stage computes the loss
    pipe = GPipe(built.module, balance=built.balance, chunks=chunks, checkpoint=checkpoint,
                 threads_per_stage=1, seed=0, devices=devices)
    timelines: list[Timeline] = []

    def step() -> None:
        pipe.train_step(built.inputs, y, built.loss_fn)
        if devices:
            torch.cuda.synchronize()
        assert pipe.timeline is not None
        timelines.append(pipe.timeline)

    timing: Timing = time_call(step, steps, warmup=1, between=lambda: built.module.zero_grad(set_to_none=True))
    built.module.zero_grad(set_to_none=True)
    runs = sorted(zip(timing.times, timelines[1:]), key=lambda r: r[0])
    seconds, timeline = runs[len(runs) // 2]
    return seconds, timeline, list(pipe.balance)


def proportional(times: dict[str, list[float]], samples: int) -> dict[int, dict[str, list[float]]]:
    """One size's per-layer times as two points of a cost with no fixed part (for a single-M grid)."""
    return {samples: times, 2 * samples: {k: [2 * t for t in v] for k, v in times.items()}}


def engine_overhead(steps: int = 3) -> float:
    """Median seconds of one action of ``GPipe`` on a near-empty workload (4 x Linear(4, 4), K=2, M=8):
    the engine's own per-action cost, which per-layer times do not contain."""
    from gpipe_lab.bench import tiny_linear

    work = tiny_linear(16, partitions=2)
    pipe = GPipe(work.module, balance=work.balance, chunks=8, threads_per_stage=1, seed=0)
    durations: list[float] = []
    for _ in range(steps + 1):
        pipe.train_step(work.inputs, work.targets, work.loss_fn)
        assert pipe.timeline is not None
        durations = [e.duration for e in pipe.timeline.events if e.kind != "wait"]
    return statistics.median(durations)


def cost_model_of(times_by_size: dict[int, dict[str, list[float]]], overhead: float, hop: float,
                  contended_by_size: dict[int, dict[str, list[float]]] | None = None) -> CostModel:
    """The simulator's cost model from per-layer times at each micro-batch size, alone and (optionally)
    contended (one size: proportional)."""
    def two_sizes(by_size: dict[int, dict[str, list[float]]]) -> dict[int, dict[str, list[float]]]:
        if len(by_size) == 1:
            (samples, times), = by_size.items()
            return proportional(times, samples)
        return by_size

    return CostModel.fit(two_sizes(times_by_size), overhead, hop,
                         None if contended_by_size is None else two_sizes(contended_by_size))


def timed_cost_model(work: WorkloadSpec, sizes: list[int], repeat: int, overhead: float, hop: float,
                     contended: bool = True) -> CostModel:
    """Time ``work``'s layers at each micro-batch size (alone, and beside a second stage when
    ``contended``) and fit the simulator's cost model from them."""
    alone = {s: layer_times(work, s, repeat) for s in sizes}
    beside = {s: layer_times(work, s, repeat, contended=True) for s in sizes} if contended else None
    return cost_model_of(alone, overhead, hop, beside)


def emulated_cost_model(emu: EmulatedSpec) -> CostModel:
    """The emulated devices' exact costs (what their layers sleep), no engine overhead, no hand-over."""
    seconds = emu.per_sample_seconds()
    forward = [LinearCost(0.0, s) for s in seconds]
    return CostModel({"forward_grad": forward, "forward_nograd": forward,
                      "backward": [LinearCost(0.0, emu.backward_ratio * s) for s in seconds]})


def hop_seconds(timeline: Timeline) -> float:
    """Median hand-over delay between stages measured in a real step (0 for one stage)."""
    if timeline.num_stages < 2:
        return 0.0
    transfer = costs_from_timeline(timeline).transfer or [0.0]
    return float(statistics.median(transfer))


def error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, or None when either is missing."""
    return None if predicted is None or not measured else (predicted - measured) / measured


def grid_progress(cfgs: Iterable[DictConfig], label: str, gpu: bool = False, note: str = "") -> Progress:
    """One ``Progress`` over every config's grid (``grid_jobs`` of its ``experiment`` block)."""
    return Progress(sum(grid_jobs(list(c.experiment.measured_k), list(c.experiment.simulated_k),
                                  list(c.experiment.chunks), gpu, emulation_settings(c.experiment)[0])
                        for c in cfgs), label, note=note)


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


def uncontended(cost: CostModel) -> CostModel:
    """``cost`` with stages that never slow each other (its alone times only)."""
    return dataclasses.replace(cost, contended=None)


def simulator_findings(rows: list[dict], error_key: str = "sim_error", alone_key: str | None = "sim_alone_error",
                       label: str = "measured cells") -> str:
    """Sentences computed from ``rows``: in how many the simulator is within 10% of the measured step,
    per K, with and (``alone_key``) without the contention term."""
    lines = []
    for multi in (False, True):
        cells = [r for r in rows if r.get(error_key) is not None and (r["K"] > 1) == multi]
        if not cells:
            continue
        within = sum(abs(r[error_key]) <= 0.10 for r in cells)
        worst = max(cells, key=lambda r: abs(r[error_key]))
        line = (f"- Simulator within 10% of the {label} at {'K >= 2' if multi else 'K = 1'} in {within} of "
                f"{len(cells)} (largest error {worst[error_key]:+.1%}, {worst['workload']} K={worst['K']} "
                f"M={worst['M']})")
        plain = [r[alone_key] for r in cells if alone_key and r.get(alone_key) is not None]
        if multi and plain and len(plain) == len(cells):
            line += (f"; without the contention term, within 10% in {sum(abs(e) <= 0.10 for e in plain)} of "
                     f"{len(cells)} (largest error {max(plain, key=abs):+.1%})")
        lines.append(line + ".")
    return "\n".join(lines)


def emulated_cell(emu: EmulatedSpec, partitions: int, chunks: int, steps: int) -> dict[str, float | None]:
    """One (K, M) step on emulated devices: seconds, samples/s, bubble, and the simulator's prediction
    from the devices' exact costs (the difference is the engine's hand-over and scheduling cost)."""
    seconds, timeline, balance = measure_step(emu, partitions, chunks, steps)  # type: ignore[arg-type]
    pred = emulated_cost_model(emu).predict(balance, chunks, emu.batch)
    return {"emulated_s": seconds, "emulated_sps": emu.batch / seconds, "emulated_sim_s": pred.step_time,
            "emulated_error": error(pred.step_time, seconds), "emulated_bubble": timeline.measured_bubble()}


def emulation_settings(e: Any) -> tuple[list[int], float]:
    """``experiment.emulated_k`` (default K = 1, 2, 4, 8) and ``experiment.emulated_forward_ms`` (default
    1600: the emulated mini-batch forward; at K=8, M=32 an action then sleeps 6 ms or more) of a config."""
    from omegaconf import OmegaConf

    ks = OmegaConf.select(e, "emulated_k", default=None)
    ms = OmegaConf.select(e, "emulated_forward_ms", default=None)
    return [1, 2, 4, 8] if ks is None else [int(k) for k in ks], 1600.0 if ms is None else float(ms)


def workload_of(block: Any, label: str | None = None) -> WorkloadSpec:
    """A ``WorkloadSpec`` from a config block ``{preset, sizes, batch}`` named ``label``, or from an
    ``experiment`` block holding ``label`` and ``workload``.

    Raises:
        KeyError: a block without ``preset``, ``sizes`` or ``batch``.
    """
    from omegaconf import OmegaConf

    if label is None:
        label, block = block.label, block.workload
    data = OmegaConf.to_container(block, resolve=True) if not isinstance(block, dict) else block
    missing = [k for k in ("preset", "sizes", "batch") if k not in data]
    if missing:
        raise KeyError(f"workload {label!r}: missing {missing} (needs preset, sizes, batch)")
    return WorkloadSpec(str(label), str(data["preset"]), dict(data["sizes"]), int(data["batch"]))


def tiny_overrides(amoebanet_config: str, transformer_config: str) -> dict[str, list[str]]:
    """``--tiny`` overrides of a throughput table's two configs: toy networks, one timed step."""
    common = ["experiment.steps=1", "experiment.repeat=1", "++experiment.emulated_k=[1,2]",
              "++experiment.emulated_forward_ms=8"]
    return {amoebanet_config: ["model.num_layers=3", "model.num_filters=8",
                             "data.batch_size=64", "data.num_train=640", *common],
            transformer_config: [
                "model.d_model=32", "model.ffn_dim=64", "model.num_heads=2", "data.batch_size=32", "data.num_train=640",
                "experiment.workload.sizes.num_layers=8", "experiment.workload.sizes.vocab_size=64",
                "experiment.workload.sizes.seq_len=8", *common]}

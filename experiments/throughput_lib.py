"""Measuring pipeline steps on CPU stages and per-layer times for the simulator.

``measure_step`` runs ``GPipe`` (one thread per stage) for a few steps, timed by
``gpipe_lab.bench``'s timer, and keeps the median step time and the timeline of
the median step. ``layer_times`` times every layer's forward (with and without
autograd) and backward on one micro-batch with one thread, the way a stage runs
it; each figure is one slice of a single chained pass (a layer's input is the
previous layer's output, its backward needs that pass's graph), so the clock is
read around each call instead of through the shared timer. ``simulate_step`` sums
those per layer over the engine's balance and runs the planner's simulator.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gpipe_lab.bench import Timing, WorkloadSpec, time_call
from gpipe_lab.pipeline import GPipe, Timeline, checkpointed_microbatches, get_schedule
from gpipe_lab.planner.simulator import StageCosts, predict_step


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


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def layer_times(work: WorkloadSpec, micro_batch: int, repeat: int = 3) -> dict[str, list[float]]:
    """Per-layer median seconds on one micro-batch, one thread: ``forward_grad``,
    ``forward_nograd`` and ``backward`` (the loss is part of the last layer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = work.build()
        model, x, y, loss_fn = built.module, built.inputs, built.targets, built.loss_fn
        x = tuple(t[:micro_batch] for t in x) if isinstance(x, tuple) else x[:micro_batch]
        y = y[:micro_batch]
        n = len(model)
        samples: dict[str, list[list[float]]] = {k: [[] for _ in range(n)] for k in
                                                 ("forward_grad", "forward_nograd", "backward")}
        for _ in range(repeat + 1):
            value, saved = x, []
            for i, layer in enumerate(model):
                ins = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _as_tuple(value))
                arg = ins if isinstance(value, tuple) else ins[0]
                start = time.perf_counter()
                with torch.no_grad():
                    layer(arg)
                samples["forward_nograd"][i].append(time.perf_counter() - start)
                start = time.perf_counter()
                out = layer(arg)
                if i == n - 1:
                    out = loss_fn(out, y)
                samples["forward_grad"][i].append(time.perf_counter() - start)
                saved.append((ins, out))
                value = out
            grads: tuple = (None,)
            for i in reversed(range(n)):
                ins, out = saved[i]
                pairs = [(o, g) for o, g in zip(_as_tuple(out), grads) if o.requires_grad]
                start = time.perf_counter()
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                samples["backward"][i].append(time.perf_counter() - start)
                grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in ins)
            model.zero_grad(set_to_none=True)
        return {k: [statistics.median(s[1:]) for s in v] for k, v in samples.items()}
    finally:
        torch.set_num_threads(threads)


def stage_costs(times: dict[str, list[float]], balance: list[int], chunks: int,
                transfer: float = 0.0) -> StageCosts:
    """Sum per-layer times over ``balance`` into simulator costs (GPipe fill-drain, except_last)."""
    fwd_key = "forward_nograd" if chunks > 1 else "forward_grad"
    sums: dict[str, list[float]] = {k: [] for k in times}
    start = 0
    for count in balance:
        for k, v in times.items():
            sums[k].append(sum(v[start:start + count]))
        start += count
    k = len(balance)
    return StageCosts(sums[fwd_key], sums["backward"], [0.0] * k, sums["forward_grad"],
                      [transfer] * max(k - 1, 0))


def simulate_step(times: dict[str, list[float]], balance: list[int], chunks: int,
                  transfer: float = 0.0) -> tuple[float, Timeline]:
    """Predicted seconds per step (and timeline) of fill-drain GPipe with ``except_last`` checkpoints."""
    costs = stage_costs(times, balance, chunks, transfer)
    pred = predict_step(get_schedule("gpipe", len(balance), chunks), costs,
                        checkpointed_microbatches("except_last", chunks))
    return pred.step_time, pred.timeline


def hop_seconds(timeline: Timeline) -> float:
    """Median hand-over delay between stages measured in a real step (0 for one stage)."""
    if timeline.num_stages < 2:
        return 0.0
    from gpipe_lab.planner.simulator import costs_from_timeline

    transfer = costs_from_timeline(timeline).transfer or [0.0]
    return float(statistics.median(transfer))


def run_grid(work: WorkloadSpec, measured_k: list[int], simulated_k: list[int], chunks: list[int],
             steps: int = 3, repeat: int = 3, gpu: bool = False) -> list[dict]:
    """Measure (K in ``measured_k``) and simulate (K in ``measured_k + simulated_k``) every M.

    With ``gpu`` every K this machine has GPUs for is measured on ``cuda:0..K-1``
    (the simulator still runs from CPU per-layer times, for comparison).

    Returns one row per (K, M): ``measured_s`` (None when not measured), ``simulated_s``,
    samples/s of each, the balance, the measured and simulated bubbles, and the timeline.
    """
    model = work.model()
    rows = []
    for m in chunks:
        times = layer_times(work, work.batch // m, repeat)
        hop = 0.0
        for k in sorted(set(measured_k) | set(simulated_k)):
            balance = work.balance(model, k)
            measured, timeline = None, None
            devices = gpu_devices(k) if gpu else None
            if k in measured_k or devices:
                measured, timeline, balance = measure_step(work, k, m, steps, devices=devices)
                hop = max(hop, hop_seconds(timeline))
            simulated, sim_timeline = simulate_step(times, balance, m, hop)
            rows.append({"workload": work.name, "K": k, "M": m, "batch": work.batch, "balance": balance,
                         "measured_s": measured, "simulated_s": simulated, "hop_s": hop,
                         "measured_sps": None if measured is None else work.batch / measured,
                         "simulated_sps": work.batch / simulated,
                         "measured_bubble": None if timeline is None else timeline.measured_bubble(),
                         "simulated_bubble": sim_timeline.measured_bubble(),
                         "timeline": timeline, "sim_timeline": sim_timeline})
    return rows


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
    common = ["experiment.steps=1", "experiment.repeat=1"]
    return {amoebanet_config: ["model.num_layers=3", "model.num_filters=8", "data.batch_size=64",
                             "data.num_train=640", *common],
            transformer_config: [
                "model.d_model=32", "model.ffn_dim=64", "model.num_heads=2", "data.batch_size=32", "data.num_train=640",
                "experiment.workload.sizes.num_layers=8", "experiment.workload.sizes.vocab_size=64",
                "experiment.workload.sizes.seq_len=8", *common]}

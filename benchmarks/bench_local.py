"""Throughput of the local (threaded) pipeline against the unpipelined module and the ideal.

For each workload, K=2 CPU stages with one intra-op thread each:
- baseline: the whole module, full batch, one thread (the paper's "one device");
- pipeline: ``GPipe.train_step`` for each M and checkpoint mode (and 1F1B);
- ideal: ``(M+K-1) · max_k t_k(mb)`` where ``t_k(mb)`` is stage k's F+B (+R for
  re-materialization) on ONE micro-batch, timed alone on one thread, so that
  the slower kernels of small micro-batches are not mistaken for bubble.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
from torch import Tensor

from benchmarks.bench_ceiling import ceiling_functions, ceiling_summary
from benchmarks.bench_common import Sizes, sync
from gpipe_lab.pipeline import GPipe, Timeline, analytic_bubble
from gpipe_lab.pipeline.measuring.call_timing import time_call, time_rounds
from gpipe_lab.planner.workload import Workload

K = 2


def _tuple(value: object) -> tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)  # type: ignore[return-value]


def _first_microbatch(value: Tensor | tuple[Tensor, ...], chunks: int) -> object:
    parts = [t.chunk(chunks)[0] for t in _tuple(value)]
    return tuple(parts) if isinstance(value, tuple) else parts[0]


def baseline_step(work: Workload, sizes: Sizes, device: str) -> dict[str, float]:
    """Forward + loss + backward of the whole module on the full batch, one thread."""
    torch.set_num_threads(1)

    def step() -> None:
        loss = work.loss_fn(work.module(work.inputs), work.targets)
        loss.backward()
        sync(device)

    return time_call(step, sizes.repeats, sizes.warmup, lambda: work.module.zero_grad(set_to_none=True)).summary()


def stage_microbatch_times(work: Workload, chunks: int, sizes: Sizes, device: str) -> list[dict[str, float]]:
    """Per stage: median seconds of F alone and of F+B on one micro-batch (one thread)."""
    torch.set_num_threads(1)
    value: object = _first_microbatch(work.inputs, chunks)
    target = work.targets.chunk(chunks)[0]
    result = []
    start = 0
    for k, n in enumerate(work.balance):
        part = work.module[start:start + n]
        start += n
        last = k == len(work.balance) - 1
        inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _tuple(value))
        arg = inputs if isinstance(value, tuple) else inputs[0]

        def forward(part=part, arg=arg, last=last) -> tuple[Tensor, ...]:
            out = part(arg)
            return (work.loss_fn(out, target),) if last else _tuple(out)

        with torch.no_grad():
            out = forward()
        grads = [None if last else torch.randn_like(o) for o in out]

        def forward_backward(forward=forward, grads=grads, last=last) -> None:
            outs = forward()
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs] if not last else None)
            sync(device)

        def forward_only(forward=forward) -> None:
            with torch.no_grad():
                forward()
            sync(device)

        reps, warm = max(3, sizes.repeats), max(1, sizes.warmup)
        f = time_call(forward_only, reps, warm).median
        fb = time_call(forward_backward, reps, warm, lambda part=part: part.zero_grad(set_to_none=True)).median
        result.append({"forward": f, "forward_backward": fb})
        with torch.no_grad():
            value = part(arg)
    work.module.zero_grad(set_to_none=True)
    return result


def pipeline_steps(work: Workload, chunks: int, configs: Sequence[tuple[str, str]], sizes: Sizes,
                   device: str, ceiling: bool = False) -> dict[tuple[str, str], dict[str, object]]:
    """Per (checkpoint, schedule): median step time, measured bubble and time per action kind of
    ``GPipe.train_step``.

    Every configuration of one M and the unpipelined baseline step run in the same rounds,
    alternating (order flipped every round), so that each speed-up is a ratio of one run:
    a shared VM's speed drifts within minutes. With ``ceiling`` the machine-ceiling runs
    (``bench_ceiling``) join the rounds.
    """
    pipes = {cfg: GPipe(work.module, balance=work.balance, chunks=chunks, checkpoint=cfg[0], schedule=cfg[1],
                        devices=[device] * K, threads_per_stage=1, seed=0) for cfg in configs}
    timelines: dict[tuple[str, str], list[Timeline]] = {cfg: [] for cfg in configs}

    def pipe_step(cfg: tuple[str, str]) -> None:
        pipes[cfg].train_step(work.inputs, work.targets, work.loss_fn)
        sync(device)

    def between() -> None:
        for cfg, pipe in pipes.items():  # the last step's timeline, read outside the timing
            if pipe.timeline is not None and (not timelines[cfg] or timelines[cfg][-1] is not pipe.timeline):
                timelines[cfg].append(pipe.timeline)
        work.module.zero_grad(set_to_none=True)

    def base_step() -> None:
        torch.set_num_threads(1)
        work.loss_fn(work.module(work.inputs), work.targets).backward()
        sync(device)

    extra = ceiling_functions(work, chunks) if ceiling else {}
    fns = {**{str(cfg): (lambda cfg=cfg: pipe_step(cfg)) for cfg in configs}, "base": base_step, **extra}
    times = time_rounds(fns, max(1, sizes.repeats), sizes.warmup, between)
    between()
    work.module.zero_grad(set_to_none=True)
    out = {}
    for cfg in configs:
        measured = timelines[cfg][sizes.warmup:]
        bubbles = [t.measured_bubble() for t in measured]
        kinds = [{kind: t.time_in(kind) for kind in ("F", "B", "R", "wait")} for t in measured]
        out[cfg] = {"step": times[str(cfg)].summary(), "baseline": times["base"].median,
                    "bubble": statistics.median_low(bubbles), "bubble_min": min(bubbles),
                    "time_in": {k: statistics.median_low([d[k] for d in kinds]) for k in kinds[0]},
                    "memory": pipes[cfg].memory(),
                    "ceiling": ceiling_summary(times["sequential"].times, times["parallel"].times, chunks)
                    if ceiling and cfg == ("never", "gpipe") else None}
    return out


def run_workload(work: Workload, sizes: Sizes, device: str, microbatches: Sequence[int],
                 checkpoints: Sequence[str], extra_1f1b: Sequence[int] = (),
                 recompute_microbatches: Sequence[int] = ()) -> dict[str, object]:
    """The baseline, the stage times per M and the pipeline grid of one workload.

    ``recompute_microbatches``: M at which the modes other than ``never`` run (empty: all).
    """
    base = baseline_step(work, sizes, device)["median"]
    stage_times: dict[int, list[dict[str, float]]] = {}
    ceilings: dict[int, dict[str, float]] = {}
    rows = []
    for m in microbatches:
        if m > work.targets.shape[0]:
            continue
        stage_times[m] = stage_microbatch_times(work, m, sizes, device)
        t_fb = max(s["forward_backward"] for s in stage_times[m])
        t_fbr = max(s["forward_backward"] + s["forward"] for s in stage_times[m])
        ideals = {"never": (m + K - 1) * t_fb, "always": (m + K - 1) * t_fbr}
        modes = [c for c in checkpoints if c == "never" or not recompute_microbatches or m in recompute_microbatches]
        runs = [(c, "gpipe") for c in modes] + ([("never", s) for s in ("1f1b", *sizes.beyond_torch)]
                                                 if m in extra_1f1b else [])
        want_ceiling = (m in (extra_1f1b if sizes.ceiling_microbatches is None else sizes.ceiling_microbatches)
                        and m in extra_1f1b and not isinstance(work.inputs, tuple))
        measured = pipeline_steps(work, m, runs, sizes, device, want_ceiling)
        for checkpoint, schedule in runs:
            res = measured[(checkpoint, schedule)]
            step = res["step"]["median"]  # type: ignore[index]
            ideal = ideals.get(checkpoint)
            ceiling = res["ceiling"]
            if ceiling:
                ceilings[m] = ceiling  # type: ignore[assignment]
            rows.append({
                "M": m, "checkpoint": checkpoint, "schedule": schedule, "step_s": step,
                "step_min_s": res["step"]["min"], "baseline_s": res["baseline"],  # type: ignore[index]
                "speedup": res["baseline"] / step,  # type: ignore[operator]
                "ideal_uncorrected_speedup": K * m / (m + K - 1),
                "ideal_step_s": ideal, "fraction_of_ideal": None if ideal is None else ideal / step,
                "bubble_measured": res["bubble"], "bubble_theory": analytic_bubble(K, m),
                "parallel_scaling": ceiling and ceiling["parallel_scaling"],
                "ceiling_step_s": ceiling and ceiling["ceiling_step_s"],
                "fraction_of_ceiling": ceiling and ceiling["ceiling_step_s"] / step,
                "time_in": res["time_in"],
            })
    work.module.zero_grad(set_to_none=True)
    return {"baseline_s": base, "stage_microbatch_s": {str(m): v for m, v in stage_times.items()},
            "ceiling": {str(m): v for m, v in ceilings.items()},
            "balance": work.balance, "info": work.info, "rows": rows}

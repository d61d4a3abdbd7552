"""GPU check sections on speed and memory: K x M against gradient accumulation, peaks (see gpu_check.py).

With ``ctx.dry`` both run at tiny sizes on the CPU (wiring only: the GPU-only
criteria are reported as ``"dry"``, never as a GPU figure).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.gpu_check_engine import Context, sync
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.call_timing import paired_ratio, time_rounds

#: seconds of matrix products before the speed rounds (clocks up from idle)
WARM_UP_S = 1.0


def _synced(step: Callable[[], Any], ctx: Context) -> Callable[[], None]:
    """``step`` timed to the end of its device work (a sync after it on a GPU)."""
    def call() -> None:
        step()
        sync(ctx)
    return call


def _warm_device(ctx: Context, seconds: float = WARM_UP_S) -> float:
    """Keep the GPU busy with bf16 matrix products for ``seconds`` (an idle GPU clocks down and
    ramps up over the first timed steps); returns the seconds spent (0 on the CPU)."""
    if ctx.device.type != "cuda":
        return 0.0
    a = torch.randn(4096, 4096, device=ctx.device, dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        sync(ctx)
    return round(time.perf_counter() - start, 2)


def _transformer(ctx: Context) -> tuple[nn.Sequential, Tensor]:
    d, layers, batch, seq = (32, 2, 4, 8) if ctx.dry else (2048, 12, 8, 512)
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.TransformerEncoderLayer(d, max(1, d // 128), 4 * d, dropout=0.0, batch_first=True)
                             for _ in range(layers)]).to(ctx.device)
    return module, torch.randn(batch, seq, d, device=ctx.device)


def _accumulation(module: nn.Sequential, x: Tensor, loss_fn: Callable, chunks: int) -> Callable[[], None]:
    """Plain PyTorch stepping the same ``chunks`` micro-batches: the zero-overhead line at that M."""
    parts = x.tensor_split(chunks)

    def step() -> None:
        for part in parts:
            (loss_fn(module(part), None) * (len(part) / len(x))).backward()
    return step


def speed(ctx: Context) -> dict[str, Any]:
    """K x M on one device (bf16 autocast) against gradient accumulation at the same M: K=1 within 5%.

    Per M, plain accumulation and the engine at every K are timed in alternating rounds (wall
    clock to a device sync, ``gpipe_lab.pipeline.measuring.call_timing.time_rounds``); each ratio is the median of the
    per-round ratios (``paired_ratio``), so a slow moment of the machine hits both sides.
    """
    module, x = _transformer(ctx)
    loss_fn = lambda out, _y: out.float().pow(2).mean()  # noqa: E731
    repeats, warmup = (2, 1) if ctx.dry else (9, 2)
    warmed = _warm_device(ctx)
    rows: dict[str, Any] = {}
    accumulation: dict[int, float] = {}
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        Ks, Ms = ((1, 2), (1, 4)) if ctx.dry else ((1, 2, 4), (1, 4, 8))
        for M in Ms:
            pipes = {K: GPipe(module, partitions=K, chunks=M, devices=[ctx.device] * K, checkpoint="never")
                     for K in Ks if K <= len(module)}
            fns = {"plain": _synced(_accumulation(module, x, loss_fn, M), ctx)}
            fns.update({f"K={K}": _synced(lambda p=pipe: p.train_step(x, x, loss_fn), ctx) for K, pipe in pipes.items()})
            timed = time_rounds(fns, repeats, warmup, between=lambda: sync(ctx))
            accumulation[M] = timed["plain"].median
            for K, pipe in pipes.items():
                t = timed[f"K={K}"]
                per_round = sorted(a / b for a, b in zip(t.times, timed["plain"].times))
                rows[f"K={K} M={M}"] = {"seconds": round(t.median, 4),
                                        "vs_accumulation": round(paired_ratio(t, timed["plain"]), 3),
                                        "vs_accumulation_range": [round(per_round[0], 3), round(per_round[-1], 3)],
                                        "timeline_wall": round(pipe.timeline.wall, 4),
                                        "device_timeline_wall": round(pipe.timeline.on_device().wall, 4)}
        K = min(2, len(module))
        bw_pipes = {schedule: GPipe(module, partitions=K, chunks=4, devices=[ctx.device] * K, schedule=schedule)
                    for schedule in ("gpipe", "gpipe-bw")}
        bw_timed = time_rounds({s: _synced(lambda p=p: p.train_step(x, x, loss_fn), ctx) for s, p in bw_pipes.items()},
                               repeats, warmup, between=lambda: sync(ctx))
    k1 = {M: rows[f"K=1 M={M}"]["vs_accumulation"] for M in accumulation}
    ok = ctx.dry or all(r <= 1.05 for r in k1.values())
    return {"status": "PASS" if ok else "FAIL",
            "accumulation_seconds": {M: round(t, 4) for M, t in accumulation.items()},
            "configs": rows, "k1_vs_accumulation": k1,
            "gpipe_vs_gpipe_bw": {s: round(t.median, 4) for s, t in bw_timed.items()},
            "rounds": repeats, "device_warm_up_seconds": warmed,
            "timing": ("wall clock (CPU, dry run)" if ctx.dry else "wall clock to a device sync")
            + f", {repeats} alternating rounds after {warmup}, paired ratios"}


#: how far ``always``'s peak may exceed ``except_last``'s (the replay's own buffers)
PEAK_SLACK = 0.05


def memory(ctx: Context) -> dict[str, Any]:
    """Device peak vs ``memory()``: never above except_last and always, which agree within
    ``PEAK_SLACK``; 1F1B below GPipe at M=8."""
    module, x = _transformer(ctx)
    loss_fn = lambda out, _y: out.float().pow(2).mean()  # noqa: E731
    peaks: dict[str, Any] = {}
    for schedule, mode in (("gpipe", "never"), ("gpipe", "except_last"), ("gpipe", "always"), ("1f1b", "never")):
        pipe = GPipe(module, partitions=2, chunks=8, devices=[ctx.device] * 2, checkpoint=mode, schedule=schedule,
                     track_memory=True)
        if ctx.device.type == "cuda":
            sync(ctx)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        pipe.train_step(x, x, loss_fn)
        peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None
        peaks[f"{schedule}/{mode}"] = {"device_peak_bytes": peak,
                                       "saved_bytes": [m["peak_activation_bytes"] for m in pipe.memory()]}
        module.zero_grad(set_to_none=True)
    key = "saved_bytes" if ctx.dry else "device_peak_bytes"

    def size(name: str) -> int:
        value = peaks[name][key]
        return sum(value) if isinstance(value, list) else int(value)

    never, except_last, always = size("gpipe/never"), size("gpipe/except_last"), size("gpipe/always")
    # except_last and always differ only in the last micro-batch, whose activations exist at its
    # backward either way (kept, or replayed): their peaks agree up to the replay's own buffers
    ordered = never >= except_last and never >= always and always <= except_last * (1 + PEAK_SLACK)
    one_f_one_b = size("1f1b/never") <= size("gpipe/never")
    return {"status": "PASS" if ordered and one_f_one_b else "FAIL", "compared": key, "peaks": peaks,
            "always/except_last": round(always / except_last, 4), "never/except_last": round(never / except_last, 4),
            "never>=except_last, always<=except_last*(1+slack)": ordered, "peak_slack": PEAK_SLACK,
            "1f1b<=gpipe": one_f_one_b}

"""GPU check sections on the engine: correctness, host syncs, speed, memory (see gpu_check.py).

Each section takes a ``Context`` and returns its figures with ``status``. With
``ctx.dry`` every section runs at tiny sizes on the CPU (wiring only: the
GPU-only criteria are reported as ``"dry"``, never as a GPU figure).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.bench.workloads import WorkloadSpec, mlp_module
from gpipe_lab.pipeline import CHECKPOINT_MODES, SCHEDULES, GPipe


@dataclass
class Context:
    """Where the check runs: ``cuda:0``, or the CPU for a dry run; ``out``: the reports' folder."""

    device: torch.device
    dry: bool
    out: Path | None = None


def _sync(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _grad_error(module: nn.Sequential, x: Any, y: Tensor, loss_fn: Callable, ctx: Context,
                dtype: torch.dtype | None = None, **options: Any) -> float:
    """Largest |pipelined − unpipelined| gradient, relative to the largest reference gradient."""
    ref, piped = copy.deepcopy(module).to(ctx.device), copy.deepcopy(module)
    autocast = (torch.autocast(ctx.device.type, dtype=dtype) if dtype is not None
                else torch.autocast(ctx.device.type, enabled=False))
    with autocast:
        loss_fn(ref(x), y).backward()
        pipe = GPipe(piped, devices=[ctx.device] * options["partitions"], **options)
        pipe.train_step(x, y, loss_fn)
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    errors = [float((a.grad - b.grad.to(a.device)).abs().max()) for a, b in zip(ref.parameters(), piped.parameters())
              if a.grad is not None]
    return max(errors) / max(scale, 1.0)


def _workloads(ctx: Context) -> dict[str, tuple[nn.Sequential, Any, Tensor, Callable]]:
    torch.manual_seed(0)
    mlp = mlp_module(16, 32, 4)
    x = torch.randn(8, 16, device=ctx.device)
    out = {"mlp": (mlp, x, torch.randn(8, 16, device=ctx.device), F.mse_loss)}
    w = WorkloadSpec("tiny", "transformer_tiny", {"dropout": 0.0, "attention_dropout": 0.0,
                                                  "relu_dropout": 0.0}, 8).build()
    tx = tuple(t.to(ctx.device) for t in w.inputs) if isinstance(w.inputs, tuple) else w.inputs.to(ctx.device)
    out["transformer_tiny"] = (w.module, tx, w.targets.to(ctx.device), w.loss_fn)
    return out


class _AllDropouts(nn.Module):
    """Every way a layer draws dropout: nn.Dropout, F.dropout, alpha dropout, attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.drop, self.alpha = nn.Dropout(0.2), nn.AlphaDropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        q = x.view(x.shape[0], 1, 4, -1)
        att = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).reshape_as(x)
        return self.alpha(self.drop(x) + F.dropout(x, 0.3, training=self.training) + att)


def correctness(ctx: Context) -> dict[str, Any]:
    """Gradients equal the unpipelined model's (fp32 1e-5, bf16 2e-2); dropout equal across checkpoint modes."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    failures, worst, runs = [], {"fp32": 0.0, "bf16": 0.0}, 0
    for name, (module, x, y, loss_fn) in _workloads(ctx).items():
        for K, schedule, mode, M in itertools.product((2, 4), SCHEDULES, CHECKPOINT_MODES, (1, 4)):
            if ctx.dry and (K == 4 or M == 4 and mode == "except_last"
                            or name != "mlp" and schedule != "gpipe"):
                continue  # the dry run wires the grid, it does not sweep it
            v = 2 if schedule.startswith("interleaved") else 1
            if K * v > len(module):
                continue
            options = dict(partitions=K, chunks=M, schedule=schedule, checkpoint=mode, virtual_stages=v)
            for label, dtype, tol in (("fp32", None, 1e-5), ("bf16", torch.bfloat16, 2e-2)):
                if label == "bf16" and (mode != "never" or M != 4):
                    continue  # bf16 once per schedule and K
                err = _grad_error(module, x, y, loss_fn, ctx, dtype, **dict(options))
                runs += 1
                worst[label] = max(worst[label], err)
                if err > tol:
                    failures.append(f"{name} K={K} {schedule} {mode} M={M} {label}: {err:.2e}")
    torch.manual_seed(1)
    body = nn.Sequential(nn.Linear(16, 16), _AllDropouts(), nn.Linear(16, 16), _AllDropouts(), nn.Linear(16, 4))
    x, y = torch.randn(8, 16, device=ctx.device), torch.randn(8, 4, device=ctx.device)
    grads = {}
    for mode in ("always", "never"):
        pipe = GPipe(copy.deepcopy(body), partitions=2, chunks=4, checkpoint=mode, seed=3,
                     devices=[ctx.device] * 2)
        pipe.train_step(x, y, F.mse_loss)
        grads[mode] = [p.grad.clone() for p in pipe.parameters()]
    dropout_equal = all(torch.equal(a, b) for a, b in zip(grads["always"], grads["never"]))
    if not dropout_equal:
        failures.append("dropout differs between checkpoint='always' and 'never'")
    return {"status": "FAIL" if failures else "PASS", "runs": runs, "worst_relative_error": worst,
            "dropout_identical_always_never": dropout_equal, "failures": failures[:20]}


_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _count_reads(step: Callable[[], Any]) -> Counter:
    """Python-level host reads of tensor values (every thread) during ``step``, by call site."""
    seen: Counter = Counter()
    lock = threading.Lock()
    originals = {n: getattr(torch.Tensor, n) for n in _READS}

    def wrap(n: str) -> Callable:
        def read(self: Tensor, *a: Any, **k: Any) -> Any:
            import traceback
            frame = traceback.extract_stack(limit=2)[0]
            with lock:
                seen[f"{n} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
            return originals[n](self, *a, **k)
        return read

    try:
        for n in _READS:
            setattr(torch.Tensor, n, wrap(n))
        step()
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
    return seen


def host_syncs(ctx: Context) -> dict[str, Any]:
    """Host syncs per local step: at most one (the non-finite verdict), with where each comes from."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 4))
    pipe = GPipe(module, partitions=2, chunks=4, deferred_batch_norm=True, nonfinite="skip",
                 devices=[ctx.device] * 2)
    x, y = torch.randn(32, 16, device=ctx.device), torch.randn(32, 4, device=ctx.device)
    pipe.train_step(x, y, F.mse_loss)
    reads = _count_reads(lambda: pipe.train_step(x, y, F.mse_loss))
    result: dict[str, Any] = {"python_reads": dict(reads)}
    if ctx.device.type == "cuda":
        _sync(ctx)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pipe.train_step(x, y, F.mse_loss)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        where = Counter(f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught
                        if "synchroniz" in str(w.message))
        result["cuda_syncs"] = dict(where)
        result["status"] = "PASS" if sum(where.values()) <= 1 else "FAIL"
    else:
        result["status"] = "PASS" if sum(reads.values()) <= 1 else "FAIL"
    return result


def _step_seconds(step: Callable[[], Any], ctx: Context, repeats: int) -> float:
    """Median seconds of ``step``: CUDA events on a GPU, the wall clock on the CPU."""
    step()
    times = []
    for _ in range(repeats):
        if ctx.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _transformer(ctx: Context) -> tuple[nn.Sequential, Tensor]:
    d, layers, batch, seq = (32, 2, 4, 8) if ctx.dry else (2048, 12, 8, 512)
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.TransformerEncoderLayer(d, max(1, d // 128), 4 * d, dropout=0.0, batch_first=True)
                             for _ in range(layers)]).to(ctx.device)
    return module, torch.randn(batch, seq, d, device=ctx.device)


def speed(ctx: Context) -> dict[str, Any]:
    """Plain vs K x M on one device (bf16 autocast): K=1 within 5% of plain; gpipe-bw vs gpipe."""
    module, x = _transformer(ctx)
    loss_fn = lambda out, _y: out.float().pow(2).mean()  # noqa: E731
    repeats = 2 if ctx.dry else 5
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        plain = _step_seconds(lambda: loss_fn(module(x), None).backward(), ctx, repeats)
        rows: dict[str, Any] = {}
        for K, M in itertools.product((1, 2, 4), (1, 4, 8)):
            if K > len(module):
                continue
            pipe = GPipe(module, partitions=K, chunks=M, devices=[ctx.device] * K, checkpoint="never")
            t = _step_seconds(lambda p=pipe: p.train_step(x, x, loss_fn), ctx, repeats)
            rows[f"K={K} M={M}"] = {"seconds": round(t, 4), "vs_plain": round(t / plain, 3),
                                    "timeline_wall": round(pipe.timeline.wall, 4),
                                    "device_timeline_wall": round(pipe.timeline.on_device().wall, 4)}
        K = min(2, len(module))
        bw = {}
        for schedule in ("gpipe", "gpipe-bw"):
            pipe = GPipe(module, partitions=K, chunks=4, devices=[ctx.device] * K, schedule=schedule)
            bw[schedule] = round(_step_seconds(lambda p=pipe: p.train_step(x, x, loss_fn), ctx, repeats), 4)
    k1 = rows["K=1 M=1"]["vs_plain"]
    return {"status": "PASS" if ctx.dry or k1 <= 1.05 else "FAIL", "plain_seconds": round(plain, 4), "configs": rows,
            "k1_vs_plain": k1, "gpipe_vs_gpipe_bw": bw,
            "timing": "wall clock (CPU, dry run)" if ctx.dry else "CUDA events"}


def memory(ctx: Context) -> dict[str, Any]:
    """Device peak vs ``memory()``: never > except_last > always; 1F1B below GPipe at M=8."""
    module, x = _transformer(ctx)
    loss_fn = lambda out, _y: out.float().pow(2).mean()  # noqa: E731
    peaks: dict[str, Any] = {}
    for schedule, mode in (("gpipe", "never"), ("gpipe", "except_last"), ("gpipe", "always"), ("1f1b", "never")):
        pipe = GPipe(module, partitions=2, chunks=8, devices=[ctx.device] * 2, checkpoint=mode, schedule=schedule,
                     track_memory=True)
        if ctx.device.type == "cuda":
            _sync(ctx)
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

    ordered = size("gpipe/never") >= size("gpipe/except_last") >= size("gpipe/always")
    one_f_one_b = size("1f1b/never") <= size("gpipe/never")
    return {"status": "PASS" if ordered and one_f_one_b else "FAIL", "compared": key, "peaks": peaks,
            "never>=except_last>=always": ordered, "1f1b<=gpipe": one_f_one_b}

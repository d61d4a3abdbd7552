"""Where a slow GPU step's time goes: host syncs with their stacks, feature variants, profiles of every thread.

    python -m benchmarks.gpu_diagnose_threads [OUT_DIR]   # on a machine with a GPU (about 50 s)

The probe that found the per-step rebuild of cuDNN's attention plans (README, "GPUs").
Prints: (1) each host sync of a small K=2 step with the Python stack that caused it;
(2) on the speed section's Transformer (12 encoder layers, d=2048, batch 8 x 512, bf16
autocast) plain PyTorch at M = 1, 4 and the engine at (K, M) = (1, 1), (2, 1), (1, 4)
with each feature off in turn, and the caching allocator's segment counts; (3) for K = 1
and 2 at M=1, cProfile of the calling thread and a ``torch.profiler`` table, with the
Chrome traces written to ``OUT_DIR/trace_K<k>.json`` (read them with
``benchmarks.trace_gaps``); (4) a sampling profiler over every other thread (cProfile sees
only the caller's), stacks and inclusive frames. Output: ``results/gpu_runs/diagnose_threads_*.txt``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_step_costs import loss_fn, median_ms
from gpipe_lab.bench.script_launch import fresh_out
from gpipe_lab.pipeline import GPipe

VARIANTS: dict[str, dict[str, object]] = {
    "default": {}, "replay_off": {"random_replay": False}, "memory_off": {"track_memory": False},
    "nonfinite_ignore": {"nonfinite": "ignore"},
    "all_off": {"random_replay": False, "track_memory": False, "nonfinite": "ignore"},
}


def log(*parts: object) -> None:
    print(*parts, flush=True)


def sync_stacks(dev: torch.device) -> None:
    """Every host sync of one small K=2 step, with the stack that caused it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 4))
    pipe = GPipe(model, partitions=2, chunks=4, deferred_batch_norm=True, nonfinite="skip", devices=[dev] * 2)
    x, y = torch.randn(32, 16, device=dev), torch.randn(32, 4, device=dev)
    pipe.train_step(x, y, F.mse_loss)
    torch.cuda.synchronize()
    stacks: Counter = Counter()

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if "synchroniz" in str(message):
            stacks["".join(traceback.format_stack(limit=9)[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pipe.train_step(x, y, F.mse_loss)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for stack, n in stacks.items():
        log(f"=== sync x{n}\n{stack}")


def sample_threads(step: Callable[[], object], steps: int = 4, every: float = 0.0005) -> tuple[Counter, Counter]:
    """Stacks (7 frames) and inclusive frames of every thread but the caller's while ``step`` runs."""
    counts: Counter = Counter()
    frames: Counter = Counter()
    stop = threading.Event()
    caller = threading.get_ident()

    def run() -> None:
        while not stop.is_set():
            for tid, frame in sys._current_frames().items():
                if tid in (caller, threading.get_ident()):
                    continue
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}:{code.co_name}")
                    frame = frame.f_back
                if "threading.py" in stack[0] and "wait" in stack[0]:
                    continue
                counts[" < ".join(stack[:7])] += 1
                for name in stack[:12]:
                    frames[name] += 1
            stop.wait(every)  # the sampling interval

    sampler = threading.Thread(target=run, daemon=True)
    sampler.start()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    stop.set()
    sampler.join()
    return counts, frames


def trace_folder(argv: list[str]) -> Path:
    """Where the profiler traces go: ``argv``'s one folder, else a fresh one outside the repository.

    Raises:
        SystemExit: more than one argument (the usage line).
    """
    if len(argv) > 1:
        raise SystemExit("usage: python -m benchmarks.gpu_diagnose_threads [OUT_DIR]")
    return Path(argv[0]) if argv else fresh_out(Path(tempfile.gettempdir()) / "gpipe-lab", "gpu_diagnose_threads")


def main(argv: list[str] | None = None) -> int:
    out = trace_folder(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_diagnose_threads needs a CUDA device")
    dev = torch.device("cuda", 0)
    out.mkdir(parents=True, exist_ok=True)
    log(f"profiler traces go to {out}")
    sync_stacks(dev)
    torch.manual_seed(0)
    d, layers, batch, seq = 2048, 12, 8, 512
    module = nn.Sequential(*[nn.TransformerEncoderLayer(d, d // 128, 4 * d, dropout=0.0, batch_first=True)
                             for _ in range(layers)]).to(dev)
    x = torch.randn(batch, seq, d, device=dev)

    def plain(chunks: int) -> Callable[[], None]:
        parts = x.tensor_split(chunks)

        def step() -> None:
            for part in parts:
                (loss_fn(module(part), None) * (len(part) / len(x))).backward()
        return step

    def segments() -> tuple:
        stats = torch.cuda.memory_stats(dev)
        return stats.get("num_alloc_retries"), stats.get("segment.all.allocated"), stats.get("num_device_alloc")

    with torch.autocast("cuda", dtype=torch.bfloat16):
        for M in (1, 4):
            log(f"plain M={M}: {median_ms(plain(M), n=5):.1f} ms")
        for K, M in ((1, 1), (2, 1), (1, 4)):
            for name, options in VARIANTS.items():
                pipe = GPipe(module, partitions=K, chunks=M, devices=[dev] * K, checkpoint="never", **options)
                before = segments()
                ms = median_ms(lambda p=pipe: p.train_step(x, x, loss_fn), n=5)
                log(f"K={K} M={M} {name}: {ms:.1f} ms  allocs before/after {before} {segments()}")
        for K in (1, 2):
            pipe = GPipe(module, partitions=K, chunks=1, devices=[dev] * K, checkpoint="never")
            pipe.train_step(x, x, loss_fn)
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            pipe.train_step(x, x, loss_fn)
            torch.cuda.synchronize()
            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(45)
            log(f"##### cProfile K={K} M=1 (main thread only)\n" + text.getvalue())
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                pipe.train_step(x, x, loss_fn)
                torch.cuda.synchronize()
            log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
            prof.export_chrome_trace(str(out / f"trace_K{K}.json.gz"))
        for K in (1, 2):
            pipe = GPipe(module, partitions=K, chunks=1, devices=[dev] * K, checkpoint="never")
            pipe.train_step(x, x, loss_fn)
            torch.cuda.synchronize()
            counts, frames = sample_threads(lambda p=pipe: p.train_step(x, x, loss_fn))
            log(f"##### samples K={K} M=1: {sum(counts.values())}")
            for stack, n in counts.most_common(25):
                log(f"{n:6d} {stack}")
            log("--- frames (inclusive)")
            for name, n in frames.most_common(40):
                log(f"{n:6d} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

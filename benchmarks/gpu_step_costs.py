"""Where a K=1, M=1 GPU step spends its time outside its device actions (a one-GPU probe).

    python -m benchmarks.gpu_step_costs        # on a machine with a GPU (about 25 s)

The speed section's Transformer (``gpu_check_speed``: 12 encoder layers, d=2048, batch
8 x 512, bf16 autocast): plain PyTorch's step, then the engine at K=1, M=1 with every
default and with memory counting, random replay, the non-finite verdict, or all three
off (wall clock to a device sync, median of 7 after one warm-up); then one profiled
step: host start to first kernel, device gaps over 0.2 ms, the host operations before
the first kernel and around the last kernels. Output: ``results/gpu_runs/step_costs_*.txt``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from gpipe_lab.pipeline import GPipe

VARIANTS: dict[str, dict[str, object]] = {
    "default": {}, "memory_off": {"track_memory": False}, "replay_off": {"random_replay": False},
    "verdict_off": {"nonfinite": "ignore"},
    "all_off": {"track_memory": False, "random_replay": False, "nonfinite": "ignore"},
}


def loss_fn(out: Tensor, _target: object) -> Tensor:
    return out.float().pow(2).mean()


def median_ms(step: Callable[[], object], n: int = 7) -> float:
    """Median wall-clock milliseconds of ``step`` to a device sync, after one warm-up call."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_step_costs needs a CUDA device")
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    d, layers, batch, seq = 2048, 12, 8, 512
    module = nn.Sequential(*[nn.TransformerEncoderLayer(d, d // 128, 4 * d, dropout=0.0, batch_first=True)
                             for _ in range(layers)]).to(dev)
    x = torch.randn(batch, seq, d, device=dev)

    def plain() -> None:
        loss_fn(module(x), None).backward()

    with torch.autocast("cuda", dtype=torch.bfloat16):
        print(f"plain M=1: {median_ms(plain):.1f} ms", flush=True)
        for name, options in VARIANTS.items():
            pipe = GPipe(module, partitions=1, chunks=1, devices=[dev], checkpoint="never", **options)
            print(f"K=1 M=1 {name}: {median_ms(lambda p=pipe: p.train_step(x, x, loss_fn)):.1f} ms", flush=True)
        pipe = GPipe(module, partitions=1, chunks=1, devices=[dev], checkpoint="never")
        for _ in range(3):
            pipe.train_step(x, x, loss_fn)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            pipe.train_step(x, x, loss_fn)
            torch.cuda.synchronize()
    print_profile(list(prof.events()))
    return 0


def print_profile(events: list) -> None:
    """Host start to first kernel, device gaps, and the host operations at both ends of the step."""
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    t0 = min(e.time_range.start for e in cpu)
    first, last = kernels[0].time_range.start, max(e.time_range.end for e in kernels)
    print(f"host start -> first kernel: {(first - t0) / 1e3:.2f} ms; last kernel end: {(last - t0) / 1e3:.2f} ms; "
          f"host end: {(max(e.time_range.end for e in cpu) - t0) / 1e3:.2f} ms", flush=True)
    gaps, end = [], kernels[0].time_range.start
    for e in kernels:
        if e.time_range.start - end > 200:
            gaps.append((end, e.time_range.start))
        end = max(end, e.time_range.end)
    print("device gaps > 0.2 ms:", [(round((a - t0) / 1e3, 2), round((b - a) / 1e3, 2)) for a, b in gaps][:20])
    before: Counter = Counter()
    for e in cpu:
        if e.time_range.start < first and e.time_range.end - e.time_range.start > 50:
            before[(e.name[:70], e.stack[0][:80] if e.stack else "")] += e.time_range.end - e.time_range.start
    for (name, where), us in before.most_common(25):
        print(f"  pre {us / 1e3:7.2f} ms  {name}  @ {where}")
    tail: Counter = Counter()
    for e in cpu:
        if e.time_range.end > kernels[-40].time_range.start and e.time_range.end - e.time_range.start > 50:
            tail[e.name[:70]] += e.time_range.end - e.time_range.start
    for name, us in tail.most_common(15):
        print(f"  tail {us / 1e3:7.2f} ms  {name}")
    print("last kernels:", [k.name[:40] for k in kernels[-12:]])


if __name__ == "__main__":
    raise SystemExit(main())

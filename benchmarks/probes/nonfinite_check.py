"""Probe: the read-only non-finite check of a step's gradients, per kernel, on the CPU.

Times, on one intra-op thread, the candidate passes over the same gradients: ``gradient_flag``
as the engine calls it, ``torch._foreach_norm`` of order inf (the fused read-only kernel the
engine uses on CUDA), one ``aminmax`` per tensor (what ``gradient_flag`` runs on the CPU) and
``GradScaler``'s check at scale one (which rewrites every value). Run on a quiet machine:

    python -m benchmarks.probes.nonfinite_check [--tensors 8] [--side 2048] [--repeat 5]

Prints the median milliseconds of each pass.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpipe_lab.pipeline.step.nonfinite import gradient_flag


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--side", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    grads = [torch.randn(args.side, args.side) for _ in range(args.tensors)]
    passes = {
        "gradient_flag (engine)": lambda: gradient_flag(grads),
        "foreach_norm, order inf": lambda: torch._foreach_norm(grads, float("inf")),
        "aminmax per tensor": lambda: [torch.aminmax(g) for g in grads],
        "GradScaler check, scale 1": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, torch.zeros(1), torch.ones(1)),
    }
    print(f"{args.tensors} x {args.side}^2 float32 gradients, one thread, median of {args.repeat}")
    for name, fn in passes.items():
        print(f"  {name:28s} {median_ms(fn, args.repeat):8.1f} ms")


if __name__ == "__main__":
    main()

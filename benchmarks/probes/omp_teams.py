"""Probe: a multi-threaded CPU stage on a thread of its own, beside the caller's OpenMP team.

libgomp gives each thread that starts a parallel region a team of its own. This times one
single-stage step (F+B of M micro-batches of the AmoebaNet analogue, two intra-op threads) three
ways, after the caller's thread has run one multi-threaded op: on a fresh thread (a stage worker),
on the caller's thread (what ``GPipe`` does for one CPU stage of several threads), and on a fresh
thread when the caller never ran one (a clean reference). Run on a quiet machine:

    python -m benchmarks.probes.omp_teams [--microbatches 4] [--steps 4]

Prints the median step of each way and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from gpipe_lab.planner.workload import WorkloadSpec

SPEC = WorkloadSpec("amoebanet", "amoebanet_d", dict(num_layers=18, num_filters=32, num_classes=10,
                                                     image_size=32), 256)


def _timed_steps(step: object, steps: int, on_caller: bool) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if on_caller:
            step()  # type: ignore[operator]
        else:
            worker = threading.Thread(target=step)  # type: ignore[arg-type]
            worker.start()
            worker.join()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first step warms the caches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    work = SPEC.build(1, 0)
    pairs = list(zip(work.inputs.chunk(args.microbatches), work.targets.chunk(args.microbatches)))

    def step() -> None:
        torch.set_num_threads(2)
        for x, y in pairs:
            work.loss_fn(work.module(x), y).backward()
        work.module.zero_grad(set_to_none=True)

    torch.set_num_threads(2)
    clean = _timed_steps(step, args.steps, on_caller=False)
    (torch.randn(4_000_000) * 2).sum()  # the caller's first multi-threaded op: its team exists now
    worker = _timed_steps(step, args.steps, on_caller=False)
    caller = _timed_steps(step, args.steps, on_caller=True)
    print(f"M={args.microbatches}, two intra-op threads, median of {args.steps - 1} steps: "
          f"fresh thread before the caller's team {clean:.3f} s; fresh thread beside it {worker:.3f} s; "
          f"on the caller's thread {caller:.3f} s; beside / on the caller {worker / caller:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Probe: the non-finite gradient check at the end of a local step, at K=1 and K=2.

Two pipelines with the same weights run the same step in alternated rounds, one with
``nonfinite="raise"`` (the default: every stage's gradients are checked) and one with
``nonfinite="ignore"`` (nothing is checked). Per step it takes the *tail*: from the end of the
step's last backward action (the step's timeline) to ``train_step``'s return, i.e. what the step
does after the drain, and the step's whole time; it prints their medians, with the check alone over
all the step's gradients (``gradient_flag`` on one thread) beside them. Where each stage's worker
checks its own gradients as soon as they are final (``step/stage_flags.py``), stage 1's check at
K=2 runs during stage 0's last backward and only stage 0's is left in the tail; where the check
runs after the drain, the tail holds every stage's. The layers are wide and the batch small, so
the check is a visible part of the step::

    python -m benchmarks.probes.nonfinite_overlap [--width 2048] [--batch 64] [--rounds 15] [--caller-threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.call_timing import time_call
from gpipe_lab.pipeline.step.nonfinite import gradient_flag


def model(width: int, stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers)


def tail_and_step(pipe: GPipe, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One step: seconds from its last backward action's end to the return, and its whole time."""
    start = time.perf_counter()
    pipe.train_step(x, y, F.mse_loss)
    end = time.perf_counter()
    timeline = pipe.timeline
    assert timeline is not None
    return end - max(e.end for e in timeline.events if e.kind in "BW"), end - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--caller-threads", type=int, default=None,
                        help="the caller's intra-op threads (default: the process's); 1 gives a check "
                             "run by the caller the threads of a stage's worker on a busy machine")
    args = parser.parse_args(argv)
    if args.caller_threads is not None:
        torch.set_num_threads(args.caller_threads)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    print(f"width {args.width}, batch {args.batch}, M={args.chunks}, caller threads {torch.get_num_threads()}, "
          f"medians of {args.rounds} alternated rounds (ms)")
    for stages in (1, 2):
        pipes = {policy: GPipe(model(args.width, stages), partitions=stages, chunks=args.chunks,
                               checkpoint="never", nonfinite=policy) for policy in ("raise", "ignore")}
        seen: dict[str, list[tuple[float, float]]] = {policy: [] for policy in pipes}
        for i in range(args.rounds + 2):  # two rounds of warm-up
            for policy in list(pipes) if i % 2 == 0 else list(pipes)[::-1]:
                measured = tail_and_step(pipes[policy], x, y)
                if i >= 2:
                    seen[policy].append(measured)
        grads = [p.grad for p in pipes["raise"].parameters()]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as a stage's worker of K=2 on two cores
        alone = time_call(lambda grads=grads: gradient_flag(grads), args.rounds, warmup=1)
        torch.set_num_threads(threads)
        line = [f"  K={stages}:"]
        for policy, pairs in seen.items():
            tail, step = (statistics.median(v) * 1e3 for v in zip(*pairs))
            line.append(f"{policy}: tail {tail:6.2f}, step {step:7.1f};")
        line.append(f"the check alone {statistics.median(alone.times) * 1e3:6.2f}")
        print(" ".join(line))


if __name__ == "__main__":
    main()

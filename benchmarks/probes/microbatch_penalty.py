"""Probe: what micro-batching alone costs on this CPU (no engine, one thread).

Times, alternately in the same rounds, the 8-block MLP's forward and
forward+backward on the full batch (1024 rows) and as M micro-batches
(128 rows each at M=8), with and without gradient accumulation between them.

    python -m benchmarks.probes.microbatch_penalty [M] [rounds]   # from the repository root; the first round warms up
"""

from __future__ import annotations

if not __package__:  # started as a file (``python benchmarks/probes/microbatch_penalty.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import sys

import torch

from benchmarks.bench_common import probe_mlp
from gpipe_lab.pipeline.measuring.call_timing import time_rounds


def main() -> None:
    chunks, rounds, work = probe_mlp(sys.argv[1:])
    model, x, y, loss_fn = work.module, work.inputs, work.targets, work.loss_fn

    def forward_full() -> None:
        with torch.no_grad():
            model(x)

    def forward_micro() -> None:
        with torch.no_grad():
            for part in x.chunk(chunks):
                model(part)

    def step_full() -> None:
        loss_fn(model(x), y).backward()

    def step_micro() -> None:
        for a, b in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(model(a), b) / chunks).backward()

    def step_micro_no_accumulation() -> None:
        for a, b in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(model(a), b) / chunks).backward()
            model.zero_grad(set_to_none=True)

    fns = {"forward full": forward_full, f"forward {chunks} micro-batches": forward_micro,
           "F+B full": step_full, f"F+B {chunks} micro-batches": step_micro,
           f"F+B {chunks} micro-batches, no accumulation": step_micro_no_accumulation}
    timings = time_rounds(fns, max(1, rounds - 1), 1, lambda: model.zero_grad(set_to_none=True))
    for name, timing in timings.items():
        print(f"{name:45s} {timing.median:.3f} s")


if __name__ == "__main__":
    main()

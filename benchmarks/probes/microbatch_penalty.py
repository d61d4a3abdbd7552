"""Probe: what micro-batching alone costs on this CPU (no engine, one thread).

Times, alternately in the same rounds, the 8-block MLP's forward and
forward+backward on the full batch (1024 rows) and as M micro-batches
(128 rows each at M=8), with and without gradient accumulation between them.

    python benchmarks/probes/microbatch_penalty.py [M] [rounds]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_common import SIZES, alternating_medians, make_workload, prepare_process  # noqa: E402


def main() -> None:
    chunks = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    prepare_process()
    torch.set_num_threads(1)
    work = make_workload("mlp", SIZES["quick"])
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
    medians = alternating_medians(fns, rounds, lambda: model.zero_grad(set_to_none=True))
    for name, seconds in medians.items():
        print(f"{name:45s} {seconds:.3f} s")


if __name__ == "__main__":
    main()

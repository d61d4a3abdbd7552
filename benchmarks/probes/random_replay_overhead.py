"""Probe: what random replay (``pipeline.random_replay``) costs per training step on this CPU.

Times ``GPipe.train_step`` (K=2, checkpoint "except_last") with the replay mode
on and off, alternately in the same rounds, on the 8-block MLP of the
benchmarks (quick sizes: batch 1024, width 512, hidden 2048, M=8) and on
``transformer_tiny`` (batch 64, M=4, dropout 0 and 0.1). "Off" swaps the mode
for a no-op, which is wrong with dropout under re-materialization: a timing
reference only.

    python -m benchmarks.probes.random_replay_overhead [rounds]
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

from benchmarks.bench_common import SIZES, make_workload
from gpipe_lab.models import build
from gpipe_lab.models.losses import translation_loss
from gpipe_lab.pipeline import GPipe, context


class _Off(contextlib.nullcontext):
    draws = 0  # read by the stage like the real mode's count

    def __init__(self, generator: object) -> None:
        super().__init__()


def _step_time(pipe: GPipe, inputs: object, targets: object, loss_fn: object, replay: bool) -> float:
    context.RandomReplay = _REPLAY if replay else _Off  # type: ignore[misc]
    pipe.module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    pipe.train_step(inputs, targets, loss_fn)  # type: ignore[arg-type]
    return time.perf_counter() - start


def measure(name: str, pipe: GPipe, inputs: object, targets: object, loss_fn: object, rounds: int) -> None:
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds + 1):
        for replay in ((True, False) if r % 2 else (False, True)):
            t = _step_time(pipe, inputs, targets, loss_fn, replay)
            if r:  # round 0 warms up
                times[replay].append(t)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{name}: replay on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms per step "
          f"({(on / off - 1) * 100:+.1f}%, medians of {rounds})", flush=True)


_REPLAY = context.RandomReplay


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    mlp = make_workload("mlp", SIZES["quick"])
    pipe = GPipe(mlp.module, balance=mlp.balance, chunks=8, checkpoint="except_last", seed=0)
    measure("8-block MLP (K=2, M=8)", pipe, mlp.inputs, mlp.targets, mlp.loss_fn, rounds)
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        model = build("transformer_tiny", dropout=dropout, attention_dropout=dropout, relu_dropout=dropout)
        seq, vocab = model.spec.options["seq_len"], model.spec.options["vocab_size"]
        src, tgt = torch.randint(4, vocab, (64, seq)), torch.randint(4, vocab, (64, seq + 1))
        pipe = GPipe(model, partitions=2, chunks=4, checkpoint="except_last", seed=0)
        measure(f"transformer_tiny dropout={dropout} (K=2, M=4)", pipe, (src, tgt[:, :-1].contiguous()),
                tgt[:, 1:].contiguous(), translation_loss(), rounds)
    context.RandomReplay = _REPLAY  # type: ignore[misc]


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)

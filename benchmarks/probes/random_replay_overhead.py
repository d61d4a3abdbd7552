"""Probe: what random replay (``pipeline.random_replay``) costs per training step on this CPU.

Times ``GPipe.train_step`` (K=2, M=4, checkpoint "except_last", one intra-op thread per
stage) with ``random_replay`` = ``"auto"`` (the default), ``True`` (the per-op mode on
every forward) and ``False`` (only ``nn.Dropout`` replayed: the reference that pays
nothing), alternated in the same rounds, on models that draw nothing (the 8-block MLP,
``transformer_tiny`` with dropout 0, ``amoebanet_d_tiny``) and on ``transformer_tiny``
with dropout 0.1 (draws only through ``nn.Dropout``), at the yardstick's quick sizes.
Then the dropout kernel alone, forward and backward: the float-mask way ``StageDropout``
drew before (float mask, bool copy, ``where``, scale) against ``dropout_kernel.fused_dropout``.

    python -m benchmarks.probes.random_replay_overhead [rounds]
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

import torch

from benchmarks.bench_common import SIZES, make_workload, prepare_process
from gpipe_lab.bench import Workload, WorkloadSpec, time_rounds
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.dropout_kernel import fused_dropout

SETTINGS = {"auto": "auto", "True": True, "False": False}
TRANSFORMER = dict(seq_len=32, num_layers=3, d_model=128, ffn_dim=512, num_heads=4, vocab_size=256)


def builders() -> dict[str, Callable[[], Workload]]:
    """Each workload's builder (every contender trains its own copy, built from the same seed)."""
    quick = SIZES["quick"]
    no_dropout = dict(TRANSFORMER, dropout=0.0, attention_dropout=0.0, relu_dropout=0.0)
    return {
        "8-block MLP (draws nothing)": lambda: make_workload(
            "mlp", dataclasses.replace(quick, mlp_batch=quick.yardstick_mlp_batch)),
        "transformer_tiny, dropout 0 (draws nothing)": lambda: WorkloadSpec(
            "transformer", "transformer_tiny", no_dropout, 64).build(2, 0),
        "amoebanet_d_tiny (draws nothing)": lambda: make_workload("amoebanet", quick),
        "transformer_tiny, dropout 0.1 (nn.Dropout)": lambda: WorkloadSpec(
            "transformer", "transformer_tiny", dict(TRANSFORMER, dropout=0.1), 64).build(2, 0),
    }


def measure(name: str, build: Callable[[], Workload], rounds: int) -> None:
    """Median step time of each setting and its cost against ``False``, in one run."""
    fns: dict[str, Callable[[], object]] = {}
    works = []
    for label, setting in SETTINGS.items():
        work = build()
        pipe = GPipe(work.module, balance=list(work.balance), chunks=4, checkpoint="except_last", seed=0,
                     threads_per_stage=1, random_replay=setting)
        works.append(work)
        fns[label] = lambda pipe=pipe, work=work: pipe.train_step(work.inputs, work.targets, work.loss_fn)

    def zero() -> None:
        for work in works:
            work.module.zero_grad(set_to_none=True)

    times = time_rounds(fns, rounds, 1, zero)
    off = times["False"].median
    print(f"{name}: off {off * 1e3:.1f} ms/step; auto {(times['auto'].median / off - 1) * 100:+.1f}%, "
          f"True {(times['True'].median / off - 1) * 100:+.1f}% (medians of {rounds})", flush=True)


def dropout_kernel(rounds: int) -> None:
    """Forward + backward of a dropout of p=0.1 on [2048, 512], the float-mask way against the fused one."""
    x = torch.randn(2048, 512, requires_grad=True)
    grad = torch.ones_like(x)

    def float_mask() -> None:
        keep = torch.empty_like(x).bernoulli_(0.9, generator=torch.Generator().manual_seed(0)).bool()
        (torch.where(keep, x, x.new_zeros(())) * (1 / 0.9)).backward(grad)

    def fused() -> None:
        fused_dropout(x, 0.1, torch.Generator().manual_seed(0))[0].backward(grad)

    times = time_rounds({"float mask": float_mask, "fused": fused}, rounds * 3, 2)
    before, after = times["float mask"].median, times["fused"].median
    print(f"dropout p=0.1 on [2048, 512], forward + backward: float mask {before * 1e3:.2f} ms, "
          f"fused {after * 1e3:.2f} ms ({after / before:.2f}x)", flush=True)


def main(rounds: int) -> None:
    prepare_process()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for name, build in builders().items():
        measure(name, build, rounds)
    dropout_kernel(rounds)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)

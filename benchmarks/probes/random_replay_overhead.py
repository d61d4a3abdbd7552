"""Probe: what random replay (``pipeline.random_replay``) costs per training step on this CPU.

Times ``GPipe.train_step`` (K=2, M=4, checkpoint "except_last", one intra-op thread per
stage) with ``random_replay`` = ``"auto"`` (the default), ``True`` (the per-op mode on
every forward) and ``False`` (only ``nn.Dropout`` replayed: the reference that pays
nothing), alternated in the same rounds, on models that draw nothing (the 8-block MLP,
``transformer_tiny`` with dropout 0, ``amoebanet_d_tiny``) and on ``transformer_tiny``
with dropout 0.1 (draws only through ``nn.Dropout``), at the yardstick's quick sizes.
Step times are also taken in this process's CPU time (steadier on a loaded machine), and the
guard's own cost per forward is timed alone. Then the dropout kernel alone, forward and backward: the float-mask way ``StageDropout``
drew before (float mask, bool copy, ``where``, scale) against ``random_replay.fused_dropout``.

    python -m benchmarks.probes.random_replay_overhead [rounds]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.bench_common import SIZES, make_workload, prepare_process
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.call_timing import time_rounds
from gpipe_lab.pipeline.stage.random_replay import fused_dropout
from gpipe_lab.pipeline.stage.replay_policy import GUARD, NONE, StageReplay
from gpipe_lab.planner.workload import Workload, WorkloadSpec

SETTINGS = {"auto": "auto", "True": True, "False": False}
CHUNKS = 4
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
    """Median step time (wall and this process's CPU time) of each setting and its cost against
    ``False``, in the same alternated rounds. CPU time counts what the step itself ran, so on a
    loaded machine it shows the replay's cost better than the wall clock."""
    steps: dict[str, Callable[[], object]] = {}
    works = []
    for label, setting in SETTINGS.items():
        work = build()
        pipe = GPipe(work.module, balance=list(work.balance), chunks=CHUNKS, checkpoint="except_last", seed=0,
                     threads_per_stage=1, random_replay=setting)
        works.append(work)
        steps[label] = lambda pipe=pipe, work=work: pipe.train_step(work.inputs, work.targets, work.loss_fn)
    wall: dict[str, list[float]] = {label: [] for label in steps}
    cpu: dict[str, list[float]] = {label: [] for label in steps}
    for r in range(rounds + 1):
        for label in (list(steps) if r % 2 else list(steps)[::-1]):
            for work in works:
                work.module.zero_grad(set_to_none=True)
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[label]()
            if r:  # round 0 warms up (and probes)
                wall[label].append(time.perf_counter() - start)
                cpu[label].append(time.process_time() - start_cpu)

    def cost(times: dict[str, list[float]], label: str) -> str:
        return f"{(statistics.median(times[label]) / statistics.median(times['False']) - 1) * 100:+.1f}%"

    print(f"{name}: off {statistics.median(wall['False']) * 1e3:.0f} ms/step (CPU "
          f"{statistics.median(cpu['False']) * 1e3:.0f} ms); auto {cost(wall, 'auto')} wall, "
          f"{cost(cpu, 'auto')} CPU; True {cost(wall, 'True')} wall, {cost(cpu, 'True')} CPU "
          f"(medians of {rounds})", flush=True)


def guard_cost(repeats: int = 20000) -> float:
    """Seconds one guarded forward adds (its enter and exit around an empty forward)."""
    replay = StageReplay("auto", torch.device("cpu"), NONE, torch.nn.Sequential(), 0)
    start = time.process_time()
    for i in range(repeats):
        with replay.forward(GUARD, i, False, True):
            pass
    return (time.process_time() - start) / repeats


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
    per_forward = guard_cost()
    forwards = 2 * (2 * CHUNKS - 1)  # K=2 stages: M first forwards, M - 1 replays (except_last)
    print(f"guard: {per_forward * 1e6:.1f} us CPU per forward, {forwards} forwards a step "
          f"(K=2, M={CHUNKS}, except_last): {per_forward * forwards * 1e3:.2f} ms a step", flush=True)
    for name, build in builders().items():
        measure(name, build, rounds)
    dropout_kernel(rounds)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)

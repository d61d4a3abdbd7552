"""Two processes over gloo: our ``DistributedGPipe`` vs torch.distributed.pipelining.

Each rank holds one stage and one intra-op thread. Both frameworks get the same
workload (same seed: same weights, same batch) and the same balance. A step is
timed on rank 0 between two barriers; the median over repeats is kept. The
cases of one (workload, M, checkpoint), every framework and schedule, are
built together and their steps alternate (order flipped every round), so that
the ratio ours/torch is not skewed by the machine's drift. The unpipelined baseline (the
whole module on rank 0, one thread) runs in the same rounds, so each row's speed-up
divides a baseline timed beside it. Both frameworks run with the same allocator setting
(``prepare_process``).

torch.distributed.pipelining runs ``ScheduleGPipe`` / ``Schedule1F1B`` without
re-materialization (it has none of its own), so it is compared with our
``never`` mode. Workloads whose stage inputs are tuples (the Transformer) run
only on our transport. Each stage's own F+B of the M micro-batches, timed alone on rank 0 in
the same rounds, gives the least step any schedule could reach (``pipeline_lower_bound``):
how far each framework is from it bounds what the other could gain.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.bench_ceiling import ceiling_functions, pipeline_lower_bound
from benchmarks.bench_common import SIZES, make_workload, prepare_process
from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local
from gpipe_lab.pipeline.measuring.call_timing import time_rounds


@dataclass(frozen=True)
class GlooCase:
    """One configuration: framework ("ours" / "torch"), schedule, M, checkpoint."""

    workload: str
    framework: str
    schedule: str
    chunks: int
    checkpoint: str = "never"


def _ours(case: GlooCase, sizes_name: str, rank: int) -> tuple[Callable[[], None], Callable[[], dict]]:
    """A step function of our ``DistributedGPipe`` and what to report after the timing."""
    work = make_workload(case.workload, SIZES[sizes_name])
    pipe = DistributedGPipe(work.module, balance=work.balance, chunks=case.chunks, checkpoint=case.checkpoint,
                            schedule=case.schedule, seed=0)
    first, last = pipe.stage_index == 0, pipe.is_last_stage

    def step() -> None:
        pipe.train_step(work.inputs if first else None, work.targets if last else None, work.loss_fn)
        pipe.zero_grad(set_to_none=True)

    def report() -> dict:
        return {"bubble": pipe.gather_timeline().measured_bubble(),
                "memory": pipe.memory() if rank == 0 else None}

    return step, report


def _torch(case: GlooCase, sizes_name: str, rank: int) -> tuple[Callable[[], None], Callable[[], dict]]:
    """A step function of torch.distributed.pipelining on the same workload."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    work = make_workload(case.workload, SIZES[sizes_name])
    start = sum(work.balance[:rank])
    part = work.module[start:start + work.balance[rank]]
    stage = PipelineStage(part, rank, len(work.balance), torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case.schedule]
    schedule = cls(stage, n_microbatches=case.chunks, loss_fn=work.loss_fn)
    last = rank == len(work.balance) - 1

    def step() -> None:
        if rank == 0:
            schedule.step(work.inputs)
        elif last:
            schedule.step(target=work.targets, losses=[])
        else:
            schedule.step()
        part.zero_grad(set_to_none=True)

    return step, dict


def _baseline(workload: str, sizes_name: str, rank: int) -> Callable[[], None]:
    """The unpipelined step on rank 0 (forward + loss + backward, full batch); other ranks idle."""
    work = make_workload(workload, SIZES[sizes_name])

    def step() -> None:
        if rank == 0:
            work.loss_fn(work.module(work.inputs), work.targets).backward()
            work.module.zero_grad(set_to_none=True)

    return step


def _stages_alone(workload: str, sizes_name: str, chunks: int, rank: int,
                  stage_times: list[list[float]]) -> Callable[[], None]:
    """On rank 0: each stage's own F+B of the M micro-batches, one after the other, no hand-over
    (``bench_ceiling``), each stage's seconds appended to ``stage_times``; other ranks idle."""
    if rank != 0:
        return lambda: None
    return ceiling_functions(make_workload(workload, SIZES[sizes_name]), chunks, stage_times)["sequential"]


def _run_group(group: Sequence[GlooCase], sizes_name: str, rank: int) -> list[dict]:
    """Time the cases of one (workload, M, checkpoint) and the baseline side by side.

    Steps alternate, order flipped each round.
    """
    sizes = SIZES[sizes_name]
    made = [(case, *(_ours if case.framework == "ours" else _torch)(case, sizes_name, rank)) for case in group]
    base = _baseline(group[0].workload, sizes_name, rank)

    def across_ranks(step: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:  # ends when the slowest rank has finished its step
            step()
            dist.barrier()
        return timed

    steps = {str(j): across_ranks(step) for j, (_, step, _) in enumerate(made)}
    stage_times: list[list[float]] = [[], []]
    alone = _stages_alone(group[0].workload, sizes_name, group[0].chunks, rank, stage_times)
    repeats = max(1, sizes.gloo_repeats or sizes.repeats)
    timings = time_rounds({**steps, "baseline": across_ranks(base), "stages_alone": across_ranks(alone)},
                          repeats, sizes.warmup, between=dist.barrier)
    baseline = timings["baseline"].median
    stage_s = [statistics.median(t[-repeats:]) for t in stage_times] if rank == 0 else None
    bound = stage_s and pipeline_lower_bound(stage_s, group[0].chunks)
    return [{**case.__dict__, "step": timings[str(j)].summary(), "baseline_s": baseline,
             "speedup": baseline / timings[str(j)].median, "stage_alone_s": stage_s, "lower_bound_s": bound,
             **report(), "error": None}
            for j, (case, _, report) in enumerate(made)]


def gloo_worker(rank: int, world_size: int, cases: Sequence[GlooCase], sizes_name: str) -> list[dict]:
    """Run every case on this rank (spawned by ``run_local``); rank 0's results are kept.

    Cases that differ only by framework or schedule run side by side (``_run_group``).
    """
    torch.set_num_threads(1)
    prepare_process()
    groups: dict[tuple, list[GlooCase]] = {}
    for case in cases:
        groups.setdefault((case.workload, case.chunks, case.checkpoint), []).append(case)
    out = []
    for group in groups.values():
        try:
            out += _run_group(group, sizes_name, rank)
        except Exception as exc:  # noqa: BLE001 - one failed group must not hide the others
            out += [{**case.__dict__, "error": f"{type(exc).__name__}: {exc}"} for case in group]
        dist.barrier()
    return out


def run_gloo(cases: Sequence[GlooCase], sizes_name: str, timeout: float = 900.0) -> list[dict]:
    """Spawn 2 gloo ranks running ``cases``; returns rank 0's rows (or one error row per case)."""
    if not cases:
        return []
    results = run_local(gloo_worker, world_size=2, args=(list(cases), sizes_name), timeout=timeout,
                        backend="gloo", threads=1)
    if results[0].value is not None:
        return list(results[0].value)  # type: ignore[arg-type]
    error = next((r.error for r in results if r.error), f"exit codes {[r.exitcode for r in results]}")
    return [{**c.__dict__, "error": (error or "")[-2000:]} for c in cases]

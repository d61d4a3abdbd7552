"""Two processes over gloo: our ``DistributedGPipe`` vs torch.distributed.pipelining.

Each rank holds one stage and one intra-op thread. Both frameworks get the same
workload (same seed: same weights, same batch) and the same balance. A step is
timed on rank 0 between two barriers; the median over repeats is kept.

torch.distributed.pipelining runs ``ScheduleGPipe`` / ``Schedule1F1B`` without
re-materialization (it has none of its own), so it is compared with our
``never`` mode. Workloads whose stage inputs are tuples (the Transformer) run
only on our transport.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from bench_common import SIZES, make_workload

from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.launch import run_local


@dataclass(frozen=True)
class GlooCase:
    """One configuration: framework ("ours" / "torch"), schedule, M, checkpoint."""

    workload: str
    framework: str
    schedule: str
    chunks: int
    checkpoint: str = "never"


def _time_steps(step, repeats: int, warmup: int) -> dict[str, float]:
    times = []
    for i in range(warmup + max(1, repeats)):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    return {"median": times[len(times) // 2], "min": times[0], "max": times[-1], "n": len(times)}


def _ours(case: GlooCase, sizes_name: str, rank: int) -> dict[str, object]:
    sizes = SIZES[sizes_name]
    work = make_workload(case.workload, sizes)
    pipe = DistributedGPipe(work.module, balance=work.balance, chunks=case.chunks, checkpoint=case.checkpoint,
                            schedule=case.schedule, seed=0)
    first, last = pipe.stage_index == 0, pipe.is_last_stage
    bubbles: list[float] = []

    def step() -> None:
        pipe.train_step(work.inputs if first else None, work.targets if last else None, work.loss_fn)
        pipe.zero_grad(set_to_none=True)

    timing = _time_steps(step, sizes.repeats, sizes.warmup)
    bubbles.append(pipe.gather_timeline().measured_bubble())
    return {"step": timing, "bubble": bubbles[-1], "memory": pipe.memory() if rank == 0 else None}


def _torch(case: GlooCase, sizes_name: str, rank: int) -> dict[str, object]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    sizes = SIZES[sizes_name]
    work = make_workload(case.workload, sizes)
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

    return {"step": _time_steps(step, sizes.repeats, sizes.warmup)}


def gloo_worker(rank: int, world_size: int, cases: Sequence[GlooCase], sizes_name: str) -> list[dict]:
    """Run every case on this rank (spawned by ``run_local``); rank 0's results are kept."""
    torch.set_num_threads(1)
    out = []
    for case in cases:
        try:
            res = (_ours if case.framework == "ours" else _torch)(case, sizes_name, rank)
            out.append({**case.__dict__, **res, "error": None})
        except Exception as exc:  # noqa: BLE001 - one failed case must not hide the others
            out.append({**case.__dict__, "error": f"{type(exc).__name__}: {exc}"})
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

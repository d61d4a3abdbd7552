"""What this machine's cores deliver in parallel: the ceiling of any K=2 pipeline.

Each stage's real work of one step (F+B of its M micro-batches, inputs and
output gradients prepared beforehand, no hand-over between the stages; tensor or
tuple values between them) is run twice per round: the two stages one after the
other on one thread, and the two stages at the same time on two threads. Nothing is shared between the
threads, so their ratio is the machine's parallel scaling for this work (2.0
on two idle cores). On the 2-core VM it drifts between ~1.4 and ~2.0 during a
day (shared caches, memory bandwidth, the host's other tenants): no engine can
beat it, so the benchmark reports the pipeline against this ceiling too.

ceiling step = parallel time · (M + K - 1) / M (fill-drain at this machine's
parallel speed); fraction of ceiling = ceiling step / measured pipeline step.
``bench_local`` times both runs in the same alternating rounds as the pipeline
step and the unpipelined baseline, so all four numbers see the same machine.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gpipe_lab.planner.workload import Inputs, Workload

K = 2


def split_batch(value: Inputs, chunks: int) -> list[Inputs]:
    """``value`` cut into ``chunks`` micro-batches along dimension 0 (a tuple: each of its tensors)."""
    if isinstance(value, tuple):
        return list(zip(*(t.chunk(chunks) for t in value)))
    return list(value.chunk(chunks))


def _leaf(value: Inputs, grad: bool) -> Inputs:
    """A stage's input as its pipeline stage receives it: detached, floating tensors needing grad."""
    if isinstance(value, tuple):
        return tuple(t.detach().requires_grad_(grad and t.is_floating_point()) for t in value)
    return value.detach().requires_grad_(grad and value.is_floating_point())


def _backward(out: Inputs, grads: list[Tensor]) -> None:
    """Backward of a stage's output (tensor or tuple) from made-up gradients of its floating parts."""
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
    torch.autograd.backward(outs, grads)


def _stage_jobs(work: Workload, chunks: int) -> list[Callable[[], None]]:
    """One closure per stage running F+B of all its micro-batches (tensor or tuple values)."""
    jobs = []
    values, targets = split_batch(work.inputs, chunks), split_batch(work.targets, chunks)
    start = 0
    for k, n in enumerate(work.balance):
        part = work.module[start:start + n]
        start += n
        last = k == len(work.balance) - 1
        inputs = [_leaf(v, k > 0) for v in values]
        with torch.no_grad():
            outs = [part(v) for v in inputs]
        grads = [[] if last else [torch.randn_like(t) for t in (o if isinstance(o, tuple) else (o,))
                                  if t.is_floating_point()] for o in outs]

        def job(part: nn.Module = part, inputs: list = inputs, grads: list = grads, last: bool = last) -> None:
            torch.set_num_threads(1)
            for i, (x, g) in enumerate(zip(inputs, grads)):
                out = part(x)
                if last:
                    work.loss_fn(out, targets[i]).backward()
                else:
                    _backward(out, g)
            part.zero_grad(set_to_none=True)

        jobs.append(job)
        values = outs
    return jobs


def ceiling_functions(work: Workload, chunks: int, stage_times: list[list[float]] | None = None,
                      ) -> dict[str, Callable[[], None]]:
    """``sequential`` and ``parallel`` runs of the stages' independent work, to time alternately.

    With ``stage_times`` (a list per stage), ``sequential`` appends each stage's own seconds to it.
    """
    jobs = _stage_jobs(work, chunks)

    def sequential() -> None:
        for k, job in enumerate(jobs):
            start = time.perf_counter()
            job()
            if stage_times is not None:
                stage_times[k].append(time.perf_counter() - start)

    def parallel() -> None:
        threads = [threading.Thread(target=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return {"sequential": sequential, "parallel": parallel}


def pipeline_lower_bound(stage_s: Sequence[float], chunks: int) -> float:
    """The least step of any schedule over stages that take ``stage_s`` seconds each for all M
    micro-batches (K=2): a stage cannot start before the other's first forward of one micro-batch,
    nor end before the other's last backward of one, so the step is at least
    max(S0 + S1/M, S1 + S0/M).

    Raises:
        ValueError: not two stages.
    """
    if len(stage_s) != 2:
        raise ValueError(f"the bound is for K=2 stages, got {len(stage_s)} stage times")
    s0, s1 = stage_s
    return max(s0 + s1 / chunks, s1 + s0 / chunks)


def ceiling_summary(sequential: list[float], parallel: list[float], chunks: int,
                    stage_times: list[list[float]] | None = None) -> dict[str, object]:
    """Scaling and ceiling step from the timed runs (medians); with ``stage_times``, each stage's
    own seconds (``stage_s``), their imbalance (the slowest over the mean) and the least step of
    any schedule of those stages (``lower_bound_s``)."""
    seq, par = statistics.median(sequential), statistics.median(parallel)
    summary: dict[str, object] = {"M": chunks, "sequential_s": seq, "parallel_s": par,
                                  "parallel_scaling": seq / par, "ceiling_step_s": par * (chunks + K - 1) / chunks}
    if stage_times:
        stages = [statistics.median(t) for t in stage_times]
        summary.update(stage_s=stages, imbalance=max(stages) / statistics.fmean(stages),
                       lower_bound_s=pipeline_lower_bound(stages, chunks))
    return summary

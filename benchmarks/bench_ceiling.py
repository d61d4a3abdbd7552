"""What this machine's cores deliver in parallel: the ceiling of any K=2 pipeline.

Each stage's real work of one step (F+B of its M micro-batches, inputs and
output gradients prepared beforehand, no hand-over between the stages) is run
twice per round: the two stages one after the other on one thread, and the
two stages at the same time on two threads. Nothing is shared between the
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
from collections.abc import Callable

import torch
from torch import Tensor

from gpipe_lab.bench import Workload

K = 2


def _stage_jobs(work: Workload, chunks: int) -> list:
    """One closure per stage running F+B of all its micro-batches (single tensors only)."""
    if isinstance(work.inputs, tuple):
        raise ValueError("the ceiling is measured on single-tensor workloads (the MLP)")
    jobs = []
    values: list[Tensor] = list(work.inputs.chunk(chunks))
    targets = list(work.targets.chunk(chunks))
    start = 0
    for k, n in enumerate(work.balance):
        part = work.module[start:start + n]
        start += n
        last = k == len(work.balance) - 1
        inputs = [v.detach().requires_grad_(k > 0) for v in values]
        with torch.no_grad():
            outs = [part(v) for v in inputs]
        grads = [None if last else torch.randn_like(o) for o in outs]

        def job(part=part, inputs=inputs, grads=grads, last=last) -> None:
            torch.set_num_threads(1)
            for i, (x, g) in enumerate(zip(inputs, grads)):
                out = part(x)
                if last:
                    work.loss_fn(out, targets[i]).backward()
                else:
                    out.backward(g)
            part.zero_grad(set_to_none=True)

        jobs.append(job)
        values = outs
    return jobs


def ceiling_functions(work: Workload, chunks: int) -> dict[str, Callable[[], None]]:
    """``sequential`` and ``parallel`` runs of the stages' independent work, to time alternately."""
    jobs = _stage_jobs(work, chunks)

    def sequential() -> None:
        for job in jobs:
            job()

    def parallel() -> None:
        threads = [threading.Thread(target=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return {"sequential": sequential, "parallel": parallel}


def ceiling_summary(sequential: list[float], parallel: list[float], chunks: int) -> dict[str, float]:
    """Scaling and ceiling step from the timed runs (medians)."""
    seq, par = statistics.median(sequential), statistics.median(parallel)
    return {"M": chunks, "sequential_s": seq, "parallel_s": par, "parallel_scaling": seq / par,
            "ceiling_step_s": par * (chunks + K - 1) / chunks}

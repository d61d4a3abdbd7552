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
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from bench_common import Sizes, Workload
from torch import Tensor

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


def measure_ceiling(work: Workload, chunks: int, sizes: Sizes) -> dict[str, float]:
    """Sequential vs parallel time of the stages' independent work; medians of interleaved rounds."""
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

    times: dict[str, list[float]] = {"sequential": [], "parallel": []}
    for i in range(sizes.warmup + max(1, sizes.repeats)):
        pair = (("sequential", sequential), ("parallel", parallel))
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            fn()
            if i >= sizes.warmup:
                times[name].append(time.perf_counter() - start)
    seq, par = statistics.median(times["sequential"]), statistics.median(times["parallel"])
    return {"M": chunks, "sequential_s": seq, "parallel_s": par, "parallel_scaling": seq / par,
            "ceiling_step_s": par * (chunks + K - 1) / chunks}

"""Scheduling overhead per action: a pipeline of tiny layers on many micro-batches.

With 4 × Linear(4, 4) the compute of an action is a few microseconds, so the
step time is almost all engine work (threads, mailbox, hooks, generators):

    overhead per action = (pipelined step − unpipelined compute of the same M micro-batches)
                          / (2 · K · M actions)

The unpipelined compute runs forward + loss + backward of the whole module on
each micro-batch in turn, on one thread. The target is judged with memory counting
(saved-tensor hooks, ``track_memory``) off; the figure with it on is reported too.
"""

from __future__ import annotations

import torch

from benchmarks.bench_common import Sizes, make_workload
from gpipe_lab.bench import time_call
from gpipe_lab.pipeline import GPipe

K = 2


def run_overhead(sizes: Sizes, device: str) -> dict[str, float]:
    """Step time, compute time and the overhead per action (µs) of the tiny pipeline."""
    work = make_workload("tiny", sizes).to(torch.device(device))
    chunks = sizes.overhead_microbatches
    torch.set_num_threads(1)
    micro = list(zip(work.inputs.chunk(chunks), work.targets.chunk(chunks)))  # type: ignore[union-attr]

    def compute() -> None:
        for x, y in micro:
            work.loss_fn(work.module(x), y).backward()

    reps, warm = max(5, sizes.repeats), max(2, sizes.warmup)
    zero = lambda: work.module.zero_grad(set_to_none=True)  # noqa: E731
    compute_s = time_call(compute, reps, warm, zero).median
    actions = 2 * K * chunks

    def measure(track_memory: bool) -> tuple[float, float]:
        pipe = GPipe(work.module, balance=work.balance, chunks=chunks, checkpoint="never",
                     devices=[device] * K, threads_per_stage=1, seed=0, track_memory=track_memory)
        inside: list[float] = []

        def step() -> None:
            pipe.train_step(work.inputs, work.targets, work.loss_fn)
            assert pipe.timeline is not None
            inside.append(sum(pipe.timeline.busy()))

        step_s = time_call(step, reps, warm, zero).median
        return step_s, sorted(inside)[len(inside) // 2]

    # the scheduling overhead proper: memory counting (saved-tensor hooks) off
    step_s, inside_s = measure(track_memory=False)
    tracked_s, _ = measure(track_memory=True)
    return {"microbatches": chunks, "actions": actions, "step_s": step_s, "compute_s": compute_s,
            "overhead_per_action_us": (step_s - compute_s) / actions * 1e6,
            "overhead_with_memory_tracking_us": (tracked_s - compute_s) / actions * 1e6,
            "inside_action_us": inside_s / actions * 1e6,
            "per_tick_us": (step_s - compute_s / K) / (2 * (chunks + K - 1)) * 1e6}

"""Scheduling overhead per action: a pipeline of tiny layers on many micro-batches.

With 4 × Linear(4, 4) the compute of an action is a few microseconds, so the
step time is almost all engine work (threads, mailbox, hooks, generators):

    overhead per action = (pipelined step − unpipelined compute of the same M micro-batches)
                          / (2 · K · M actions)

The unpipelined compute runs forward + loss + backward of the whole module on
each micro-batch in turn, on one thread. The target is judged with memory counting
(saved-tensor hooks, ``track_memory``) off; the figures with it on (counted once per forward
signature, the default), counting every forward (``"every_step"``), and with ``random_replay``
off (what the replay guard costs a model that draws nothing), are reported too.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.bench_common import Sizes, make_workload
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.call_timing import paired_ratio, time_rounds

K = 2
ROUNDS = 15  # a round costs well under a second: enough rounds for a steady median


def run_overhead(sizes: Sizes, device: str) -> dict[str, float]:
    """Step time, compute time and the overhead per action (µs) of the tiny pipeline.

    The unpipelined compute and the pipeline with memory counting off and on alternate
    in the same rounds; each step's timeline is read outside its timing.
    """
    work = make_workload("tiny", sizes).to(torch.device(device))
    chunks = sizes.overhead_microbatches
    torch.set_num_threads(1)
    micro = list(zip(work.inputs.chunk(chunks), work.targets.chunk(chunks)))  # type: ignore[union-attr]

    def compute() -> None:
        for x, y in micro:
            work.loss_fn(work.module(x), y).backward()

    def pipe(track: bool | str, replay: bool | str = "auto") -> GPipe:
        return GPipe(work.module, balance=work.balance, chunks=chunks, checkpoint="never", devices=[device] * K,
                     threads_per_stage=1, seed=0, track_memory=track, random_replay=replay)

    pipes = {True: pipe(True), False: pipe(False), "every_step": pipe("every_step")}
    no_replay = pipe(False, False)
    inside: list[float] = []
    last: list[GPipe] = []

    def between() -> None:
        if last:  # the previous step's time inside its actions, read outside any timing
            assert last[0].timeline is not None
            inside.append(sum(last.pop().timeline.busy()))  # type: ignore[union-attr]
        work.module.zero_grad(set_to_none=True)

    def step(pipe: GPipe) -> None:
        pipe.train_step(work.inputs, work.targets, work.loss_fn)
        if not pipe.options.track_memory:
            last.append(pipe)

    reps = ROUNDS if sizes.name != "smoke" else max(2, sizes.repeats)
    times = time_rounds({"compute": compute, "pipe": lambda: step(pipes[False]),
                         "tracked": lambda: step(pipes[True]), "every_step": lambda: step(pipes["every_step"]),
                         "no_replay": lambda: no_replay.train_step(
                             work.inputs, work.targets, work.loss_fn)}, reps, max(2, sizes.warmup), between)
    between()
    compute_s, step_s, tracked_s, every_s, plain_s = (times[k].median for k in
                                                      ("compute", "pipe", "tracked", "every_step", "no_replay"))
    actions = 2 * K * chunks
    return {"microbatches": chunks, "actions": actions, "step_s": step_s, "compute_s": compute_s,
            "overhead_per_action_us": (step_s - compute_s) / actions * 1e6,
            "overhead_with_memory_tracking_us": (tracked_s - compute_s) / actions * 1e6,
            "overhead_counting_every_forward_us": (every_s - compute_s) / actions * 1e6,
            "overhead_without_replay_us": (plain_s - compute_s) / actions * 1e6,
            "replay_guard_share": paired_ratio(times["pipe"], times["no_replay"]) - 1,
            "inside_action_us": statistics.median(inside[-reps:]) / actions * 1e6,
            "per_tick_us": (step_s - compute_s / K) / (2 * (chunks + K - 1)) * 1e6}

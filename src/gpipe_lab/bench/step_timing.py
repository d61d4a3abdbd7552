"""Timing a pipelined training step: ``GPipe`` (one thread per stage, or one GPU each) over a few steps.

``measure_step`` keeps the median step time and the timeline of that step; given an
``EmulatedSpec`` its stages sleep instead of computing. The experiments' throughput tables
and the benchmarks' probes time their steps with it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpipe_lab.pipeline import GPipe, Timeline
from gpipe_lab.pipeline.measuring.call_timing import Timing, time_call
from gpipe_lab.planner.workload import Workload


class Buildable(Protocol):
    """What builds a ``Workload`` for K stages: a ``WorkloadSpec``, an ``EmulatedSpec``, ..."""

    def build(self, partitions: int = 1) -> Workload:
        """The workload balanced over ``partitions`` stages."""
        ...


def gpu_devices(partitions: int) -> list[str] | None:
    """``cuda:0..K-1`` when this machine has K GPUs, else None (CPU stages)."""
    return [f"cuda:{i}" for i in range(partitions)] if torch.cuda.device_count() >= partitions else None


def measure_step(work: Buildable, partitions: int, chunks: int, steps: int = 3,
                 checkpoint: str = "except_last", devices: list[str] | None = None,
                 ) -> tuple[float, Timeline, list[int]]:
    """Median seconds per training step of GPipe, the median step's timeline, the balance.

    CPU stages (one thread each) unless ``devices`` (e.g. ``gpu_devices(K)``). With
    ``partitions=1`` on CPU this is the single-stage run on one thread.
    """
    built = work.build(partitions)
    y = built.targets.to(devices[-1]) if devices else built.targets  # the last stage computes the loss
    pipe = GPipe(built.module, balance=built.balance, chunks=chunks, checkpoint=checkpoint,
                 threads_per_stage=1, seed=0, devices=devices)
    timelines: list[Timeline] = []

    def step() -> None:
        pipe.train_step(built.inputs, y, built.loss_fn)
        if devices:
            torch.cuda.synchronize()
        assert pipe.timeline is not None
        timelines.append(pipe.timeline)

    timing: Timing = time_call(step, steps, warmup=1, between=lambda: built.module.zero_grad(set_to_none=True))
    built.module.zero_grad(set_to_none=True)
    runs = sorted(zip(timing.times, timelines[1:]), key=lambda r: r[0])
    seconds, timeline = runs[len(runs) // 2]
    return seconds, timeline, list(pipe.balance)


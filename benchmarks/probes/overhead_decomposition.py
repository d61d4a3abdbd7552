"""Probe: where the scheduling overhead per action goes (4 × Linear(4, 4), K=2, ``checkpoint="never"``,
``random_replay=False``, ``track_memory=False``, one intra-op thread).

Times, alternately in the same rounds, wall and CPU (process) time of:

- plain: the whole module's forward + loss + backward per micro-batch, one thread (``bench_overhead``'s compute);
- staged: the same cut in two stages by hand (detach, a backward call per stage), one thread;
- serial: the engine's actions in an order every dependency allows, all on ONE thread (no threads, no waits);
- K=2: ``GPipe.train_step`` (a thread per stage);

and prints per action ((x - y) / (2·K·M)): the explicit per-stage backward (staged - plain), the
engine's bookkeeping (serial - staged), threads, hand-over and GIL (K=2 - serial), and their sum, the
benchmark's overhead (K=2 - plain). CPU time is less disturbed by other processes than wall time.

    python -m benchmarks.probes.overhead_decomposition [M] [rounds]   # from the repository root (default 64, 15)
"""

from __future__ import annotations

if not __package__:  # started as a file: rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import statistics
import sys
import time
import types
from collections.abc import Callable

import torch

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.pipeline.schedules import walk
from gpipe_lab.pipeline.step.channel import run_action
from gpipe_lab.pipeline.step.step_state import StepState
from gpipe_lab.planner.workload import tiny_linear


def _serial(pipe: GPipe) -> None:
    """Make ``pipe`` run every rank's actions on the calling thread, in ``walk`` order."""
    orders: dict[int, list] = {}

    def run(self, schedule, prepared, feed, sync_gradients) -> None:  # type: ignore[no-untyped-def]
        plan = self._plan(schedule)
        step = StepState(plan, feed, sync_gradients)
        ranks = [(k, self._device(schedule, k)) for k in self.endpoint.ranks]
        self.endpoint.peak_live = {s: 0 for s in self.runtimes}
        self.endpoint.open(prepared, step.mailbox, ranks)
        order = orders.setdefault(id(schedule), walk(schedule))
        position = [0] * len(schedule)
        for k, action in order:
            _, _, key, out, _, _ = plan.ranks[k][position[k]]
            position[k] += 1
            run_action(action, self.runtimes[action.stage], lambda m, a, k=k: self._receive(step, k, m, a),
                       self.endpoint, feed, key, out)
        self.endpoint.close(ranks, ok=True, sync_gradients=sync_gradients)

    pipe.executor.run = types.MethodType(run, pipe.executor)  # type: ignore[method-assign]


def main() -> None:
    chunks = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    torch.set_num_threads(1)
    work = tiny_linear(chunks)
    module, loss_fn = work.module, work.loss_fn
    micro = list(zip(work.inputs.chunk(chunks), work.targets.chunk(chunks)))  # type: ignore[union-attr]
    first, second = module[:2], module[2:]

    def plain() -> None:
        for x, y in micro:
            loss_fn(module(x), y).backward()

    def staged() -> None:
        for x, y in micro:
            h = first(x)
            boundary = h.detach().requires_grad_(True)
            loss_fn(second(boundary), y).backward()
            h.backward(boundary.grad)

    def pipe() -> GPipe:
        return GPipe(module, options=PipelineOptions(balance=[2, 2], chunks=chunks, checkpoint="never",
                                                     devices=["cpu"] * 2, threads_per_stage=1, seed=0,
                                                     track_memory=False, random_replay=False))

    threaded, serial = pipe(), pipe()
    _serial(serial)
    fns: dict[str, Callable[[], object]] = {
        "plain": plain, "staged": staged,
        "serial": lambda: serial.train_step(work.inputs, work.targets, loss_fn),
        "K=2": lambda: threaded.train_step(work.inputs, work.targets, loss_fn)}
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for i in range(rounds + 3):  # 3 warm-up rounds
        for name in list(fns) if i % 2 == 0 else list(fns)[::-1]:
            module.zero_grad(set_to_none=True)
            c0, w0 = time.process_time(), time.perf_counter()
            fns[name]()
            w1, c1 = time.perf_counter(), time.process_time()
            if i >= 3:
                wall[name].append(w1 - w0)
                cpu[name].append(c1 - c0)
    w = {n: statistics.median(v) for n, v in wall.items()}
    c = {n: statistics.median(v) for n, v in cpu.items()}
    actions = 2 * 2 * chunks
    print(f"M={chunks}, {rounds} rounds; median step ms: " + ", ".join(f"{n} {w[n] * 1e3:.2f}" for n in fns))
    for label, a, b in (("explicit per-stage backward (staged - plain)", "staged", "plain"),
                        ("engine bookkeeping (serial - staged)", "serial", "staged"),
                        ("threads, hand-over, GIL (K=2 - serial)", "K=2", "serial"),
                        ("total: the benchmark's overhead (K=2 - plain)", "K=2", "plain")):
        print(f"  {label:48s} wall {(w[a] - w[b]) / actions * 1e6:7.1f} us/action   "
              f"cpu {(c[a] - c[b]) / actions * 1e6:7.1f} us/action")


if __name__ == "__main__":
    main()

"""Probe: where the interpreter lock goes on the local transport (a thread per stage, one process).

The quick benchmark's MLP (8 blocks of Linear 512→2048, GELU, Linear 2048→512, batch 1024), K=2,
``checkpoint="never"``, one intra-op thread per stage, at each M and schedule. Per stage thread and
action, over every measured step:

- ``wall``: the thread's walk of its action list (``Executor._walk``, wrapped by this probe), per action;
- ``cpu``: the thread's CPU time over the walk (``time.thread_time``: with one intra-op thread the
  stage's kernels run on this thread, so it is the kernels plus the Python);
- ``mailbox``: the executor's ``wait`` events (blocked on the neighbour's value, the lock taken back after);
- ``gil held``: the samples in which this thread holds the lock, from ``py-spy record --gil --threads``
  attached to this process (``--rate`` per second), times the recording's seconds per sample: the
  lock held whether the thread runs or the OS preempted it while holding it (then it can exceed ``cpu``);
- ``off-cpu`` = wall − cpu − mailbox: runnable or blocked outside a neighbour wait, i.e. waiting for
  the lock, or for a core the machine's other processes hold (``/proc`` counts each thread's
  voluntary switches, blocked: the lock or the mailbox, and involuntary ones, preempted);
- the step time (median of the rounds and max/median, the round-to-round spread).

Cells alternate within each round; every cell's pipe is built once and warmed up by one step.
The sampler costs some CPU on a small machine: the step times are with it attached.

    python -m benchmarks.probes.gil_probe [--rounds 5] [--steps 2] [--out results/gil_probe]

``--py-spy`` names the sampler (default: ``py-spy`` on PATH); ``--no-sampling`` leaves the lock's
held time out. Writes ``<out>.md`` and ``<out>.json`` (machine, commit, load averages) with ``--out``.

Raises:
    SystemExit: no py-spy found without ``--no-sampling``.
"""

from __future__ import annotations

if not __package__:  # started as a file: rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_common import SIZES, make_workload, prepare_process
from gpipe_lab.bench import md_table
from gpipe_lab.bench.machine import load_average, machine_info, provenance, provenance_meta
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.step.executor import Executor

K = 2
STAGE = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\): (gpipe-stage-\d+)[;\s]")
SAMPLER_START_S = 0.5  # py-spy attaches and starts sampling within this (not a test: a plain pause)


def _switches() -> tuple[int, int]:
    """(voluntary, involuntary) context switches of the calling thread so far."""
    counts = {}
    with open(f"/proc/self/task/{threading.get_native_id()}/status", encoding="utf-8") as f:
        for line in f:
            if "ctxt_switches:" in line:
                key, value = line.split(":")
                counts[key.strip()] = int(value)
    return counts.get("voluntary_ctxt_switches", 0), counts.get("nonvoluntary_ctxt_switches", 0)


class WalkMeter:
    """Wraps ``Executor._walk``: per rank and step, wall and CPU seconds and context switches of the walk."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self.lock = threading.Lock()
        self._original = Executor._walk

    def __enter__(self) -> WalkMeter:
        original, records, lock = self._original, self.records, self.lock

        def walk(executor: Executor, step: Any, k: int) -> None:
            v0, i0 = _switches()
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                original(executor, step, k)
            finally:
                w1, c1 = time.perf_counter(), time.thread_time()
                v1, i1 = _switches()
                with lock:
                    records.append({"rank": k, "wall": w1 - w0, "cpu": c1 - c0, "voluntary": v1 - v0,
                                    "involuntary": i1 - i0})

        Executor._walk = walk  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Executor._walk = self._original  # type: ignore[method-assign]


class Sampler:
    """``py-spy record --gil --threads`` on this process while in the ``with`` block: samples per stage thread."""

    def __init__(self, py_spy: str | None, rate: int) -> None:
        self.py_spy, self.rate = py_spy, rate
        self.held: dict[str, int] = {}
        self.seconds_per_sample = 0.0

    def __enter__(self) -> Sampler:
        if self.py_spy is None:
            return self
        self._dir = tempfile.TemporaryDirectory()
        self._out = Path(self._dir.name) / "raw.txt"
        self._proc = subprocess.Popen([self.py_spy, "record", "--gil", "--threads", "--nonblocking", "-r",
                                       str(self.rate), "-f", "raw", "-o", str(self._out), "--pid", str(os.getpid())],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(SAMPLER_START_S)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.py_spy is None:
            return
        seconds = time.perf_counter() - self._start + SAMPLER_START_S
        self._proc.send_signal(signal.SIGINT)
        log, _ = self._proc.communicate(timeout=60)
        found = re.search(r"Samples: (\d+)", log)
        if found is None or not self._out.exists():
            raise RuntimeError(f"py-spy wrote no samples: {log.strip()[-400:]}")
        self.seconds_per_sample = seconds / max(1, int(found.group(1)))
        held: dict[str, int] = defaultdict(int)
        for line in self._out.read_text(encoding="utf-8").splitlines():
            match = STAGE.match(line)
            if match:
                held[match.group(1)] += int(line.rsplit(" ", 1)[1])
        self.held = dict(held)
        self._dir.cleanup()


def cell(pipe: GPipe, work: Any, steps: int, sampler: Sampler) -> dict[str, Any]:
    """``steps`` steps of ``pipe`` under the meters; per rank the walk's sums, and the step times."""
    step_s: list[float] = []
    waits = [0.0] * K
    with WalkMeter() as meter, sampler:
        for _ in range(steps):
            work.module.zero_grad(set_to_none=True)
            start = time.perf_counter()
            pipe.train_step(work.inputs, work.targets, work.loss_fn)
            step_s.append(time.perf_counter() - start)
            timeline = pipe.timeline
            assert timeline is not None
            waits = [a + b for a, b in zip(waits, timeline.waiting())]
    ranks = []
    for k in range(K):
        mine = [r for r in meter.records if r["rank"] == k]
        ranks.append({key: sum(r[key] for r in mine) for key in ("wall", "cpu", "voluntary", "involuntary")}
                     | {"mailbox": waits[k],
                        "held": sampler.held.get(f"gpipe-stage-{k}", 0) * sampler.seconds_per_sample
                        if sampler.py_spy else None})
    return {"step_s": step_s, "ranks": ranks}


def summarize(runs: list[dict[str, Any]], actions: int) -> dict[str, Any]:
    """Per rank, the per-action medians over rounds (µs; switches as counts) and the step's spread."""
    steps = [s for r in runs for s in r["step_s"]]
    rounds = [statistics.median(r["step_s"]) for r in runs]
    out: dict[str, Any] = {"step_median_s": statistics.median(steps), "step_min_s": min(steps),
                           "step_max_s": max(steps), "round_medians_s": rounds,
                           "round_spread": max(rounds) / statistics.median(rounds), "ranks": []}
    for k in range(K):
        per: dict[str, list[float]] = defaultdict(list)
        for r in runs:
            rank, n = r["ranks"][k], actions * len(r["step_s"])
            per["wall_us"].append(rank["wall"] / n * 1e6)
            per["cpu_us"].append(rank["cpu"] / n * 1e6)
            per["mailbox_us"].append(rank["mailbox"] / n * 1e6)
            per["off_cpu_us"].append((rank["wall"] - rank["cpu"] - rank["mailbox"]) / n * 1e6)
            per["voluntary"].append(rank["voluntary"] / n)
            per["involuntary"].append(rank["involuntary"] / n)
            if rank["held"] is not None:
                per["gil_held_us"].append(rank["held"] / n * 1e6)
        out["ranks"].append({key: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                             for key, v in per.items()})
    return out


def run(schedules: list[str], microbatches: list[int], rounds: int, steps: int,
        sampler: Callable[[], Sampler]) -> tuple[list[dict[str, Any]], list[list[float]]]:
    """Every (schedule, M) cell, alternated within each round; the cells' summaries and the loads seen."""
    prepare_process()
    torch.set_num_threads(1)
    work = make_workload("mlp", SIZES["quick"])
    keys = [(s, m) for m in microbatches for s in schedules]
    pipes = {key: GPipe(work.module, balance=work.balance, chunks=key[1], schedule=key[0], checkpoint="never",
                        devices=["cpu"] * K, threads_per_stage=1, seed=0) for key in keys}
    for pipe in pipes.values():  # warm-up: each pipe's first step (plans, caches, allocator)
        pipe.train_step(work.inputs, work.targets, work.loss_fn)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in keys}
    loads = []
    for i in range(rounds):
        loads.append(load_average())
        for key in keys if i % 2 == 0 else keys[::-1]:
            runs[key].append(cell(pipes[key], work, steps, sampler()))
        print(f"[gil_probe] round {i + 1}/{rounds}, load {load_average()}", flush=True)
    work.module.zero_grad(set_to_none=True)
    cells = []
    for (schedule, m), measured in runs.items():
        cells.append({"schedule": schedule, "M": m, "actions_per_rank": 2 * m, **summarize(measured, 2 * m),
                      "raw": measured})
    return cells, loads


def _us(entry: dict[str, float] | None) -> str:
    return "-" if entry is None else f"{entry['median']:.0f} ({entry['min']:.0f}–{entry['max']:.0f})"


def report(cells: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown page: a row per (schedule, M, rank)."""
    header = ["schedule", "M", "step s (min–max)", "round spread", "rank", "wall µs/action", "cpu", "gil held",
              "mailbox wait", "off-cpu outside waits", "voluntary sw./action", "involuntary"]
    body = []
    for c in cells:
        for k, r in enumerate(c["ranks"]):
            body.append([c["schedule"], c["M"], f"{c['step_median_s']:.3f} ({c['step_min_s']:.3f}–{c['step_max_s']:.3f})",
                         f"{c['round_spread']:.2f}", k, _us(r["wall_us"]), _us(r["cpu_us"]), _us(r.get("gil_held_us")),
                         _us(r["mailbox_us"]), _us(r["off_cpu_us"]),
                         f"{r['voluntary']['median']:.2f}", f"{r['involuntary']['median']:.2f}"])
    return "\n".join([
        "# Where the interpreter lock goes on the local transport (MLP, K=2, batch 1024)", "",
        provenance(), "",
        f"{meta['rounds']} alternated rounds of {meta['steps']} steps per cell after one warm-up step; per action "
        f"and stage thread, the median over rounds (min–max in brackets). Lock samples: py-spy at "
        f"{meta['rate']} Hz ({'on' if meta['sampled'] else 'off'}). Load average per round: {meta['loads']}. "
        "One CPU kind was available (the machine above), shared with other engineers' tests: the "
        "off-CPU time outside waits is the lock's wait plus the time preempted (the involuntary switches).", "",
        md_table(header, body), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per cell and round")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"))
    parser.add_argument("--no-sampling", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.md and OUT.json")
    args = parser.parse_args(argv)
    if args.py_spy is None and not args.no_sampling:
        raise SystemExit("gil_probe: py-spy not found (pip install py-spy, or pass --py-spy PATH); "
                         "--no-sampling measures without the lock's held time")
    py_spy = None if args.no_sampling else args.py_spy
    cells, loads = run(args.schedules, args.microbatches, args.rounds, args.steps,
                       lambda: Sampler(py_spy, args.rate))
    meta = {**provenance_meta(), **machine_info("cpu"), "rounds": args.rounds, "steps": args.steps,
            "rate": args.rate, "sampled": py_spy is not None, "loads": loads, "K": K,
            "model": "8 x (Linear 512-2048, GELU, Linear 2048-512), batch 1024"}
    page = report(cells, meta)
    print(page)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(page, encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1),
                                                 encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

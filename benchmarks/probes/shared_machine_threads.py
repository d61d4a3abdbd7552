"""Probe: the engine at K=1 on a shared machine, by intra-op thread setting and OpenMP wait policy.

Times the default model (``amoebanet_d_tiny``, batch 32) at K=1, M=4: the median of 5 steps
(after one warm-up step) for each thread setting (the engine's default, every count from 1 to
the usable cores), quiet and beside one and two busy processes (``python3 -c 'while True: pass'``,
started and killed by pid). Each (load, wait policy) cell runs in a fresh child process, since
libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it; within a child the thread settings
alternate step by step, so a ratio within one row compares like with like on a machine that
others share. Rounds repeat the whole grid; the table gives each cell's median over rounds.

    python -m benchmarks.probes.shared_machine_threads [--rounds 2] [--steps 5] [--busy 0 1 2]

Prints one row per (busy processes, wait policy) and each setting's ratio to one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD_TIMEOUT_S = 600
POLICIES = ("default", "passive")


def _child(steps: int, settings: list[int | None]) -> dict[str, object]:
    """Time each thread setting in this process, alternating step by step; medians in seconds."""
    import torch

    from gpipe_lab.pipeline import GPipe
    from gpipe_lab.planner.workload import WorkloadSpec

    spec = WorkloadSpec("amoebanet_d_tiny", "amoebanet_d_tiny", {}, 32)
    pipes, works = [], []
    for threads in settings:
        work = spec.build(1, 0)
        pipes.append(GPipe(work.module, balance=work.balance, chunks=4, threads_per_stage=threads, seed=0))
        works.append(work)
    times: list[list[float]] = [[] for _ in settings]
    for step in range(steps + 1):
        for i, (pipe, work) in enumerate(zip(pipes, works)):
            start = time.perf_counter()
            pipe.train_step(work.inputs, work.targets, work.loss_fn)
            pipe.zero_grad(set_to_none=True)
            if step:  # the first step of each pipe warms its caches
                times[i].append(time.perf_counter() - start)
    return {"threads": [p.threads_per_stage for p in pipes], "median_s": [statistics.median(t) for t in times],
            "torch_threads": torch.get_num_threads()}


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(timeout=30)


def _run_child(policy: str, steps: int, settings: list[int | None]) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-m", "benchmarks.probes.shared_machine_threads", "--child",
                          "--steps", str(steps), "--settings", json.dumps(settings)],
                         env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    settings: list[int | None] = json.loads(args.settings) if args.settings else [None, *range(1, cores + 1)]
    if args.child:
        print(json.dumps(_child(args.steps, settings)))
        return 0
    cells: dict[tuple[int, str], list[dict[str, object]]] = {}
    for _ in range(args.rounds):
        for n in args.busy:
            procs = _busy(n)
            try:
                for policy in args.policies:
                    cells.setdefault((n, policy), []).append(_run_child(policy, args.steps, settings))
            finally:
                _stop(procs)
    names = ["default"] + [f"{t} thr" for t in settings[1:]]
    print(f"K=1, M=4, amoebanet_d_tiny batch 32, {cores} usable cores; median of {args.steps} steps, "
          f"median over {args.rounds} round(s); seconds per step (ratio to 1 thread)")
    print("| busy | wait policy | default chose | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for (n, policy), runs in cells.items():
        med = [statistics.median(r["median_s"][i] for r in runs) for i in range(len(settings))]  # type: ignore[index]
        one = med[settings.index(1)]
        chose = sorted({r["threads"][0] for r in runs})  # type: ignore[index]
        row = " | ".join(f"{m:.3f} ({m / one:.2f}x)" for m in med)
        print(f"| {n} | {policy} | {chose} | {row} |")
    print(f"load average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

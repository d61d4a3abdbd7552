"""Every schedule (gpipe, 1f1b, zb-h1, zb-h2, gpipe-bw) on K=2 CPU stages: measured beside the prediction;
and on emulated devices (K = 2, 4, 8) the V-shaped zb-v and dualpipev beside 1f1b, zb-h1 and zb-h2: bubble
against theory (``benchmarks.schedules_emulated``).

The 8-block MLP (Linear 512->2048, GELU, Linear 2048->512), batch 1024, MSE,
no re-materialization, M in {2, 4, 8}. All schedules are measured in one run,
in alternating rounds (each round runs every schedule once), so a change in the
machine's load hits them alike; the step time is the median over rounds of the
engine's own timeline. The
prediction feeds the simulator with per-action costs measured in the same
schedule's earlier steps (median over them). The replay feeds it each step's own
action durations: replayed / measured below 1 is the share of the step lost to
hand-overs and waits that the schedule did not ask for.

    python -m benchmarks.bench_schedules --out results/schedules --steps 7   # from the repository root

Writes ``schedules.json`` (``rows``: the CPU runs; ``emulated``: the emulated devices), one
``timeline_<schedule>_M<M>.png`` per CPU configuration (the last measured step above the predicted
one), ``emulated.md`` and two emulated timelines of the V-shaped schedules.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python benchmarks/bench_schedules.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.schedules_emulated import emulated_rows, markdown
from gpipe_lab.bench import Progress, mlp
from gpipe_lab.bench.machine import ROOT, command_line, figure_metadata, git_commit, machine_info
from gpipe_lab.bench.script_launch import fresh_out
from gpipe_lab.pipeline import GPipe, Timeline, get_schedule
from gpipe_lab.pipeline.measuring.call_timing import time_rounds
from gpipe_lab.planner import costs_from_timeline, durations_from_timeline, predict_step
from gpipe_lab.plotting import plot_timeline

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "gpipe-bw")


def bench_chunks(chunks: int, steps: int, warmup: int, out: Path) -> list[dict]:
    """One row per schedule at M=``chunks``: measured and predicted step, replay ratio, bubbles, costs."""
    works = {name: mlp(1024, 512, 2048) for name in SCHEDULES}
    pipes = {name: GPipe(w.module, balance=w.balance, chunks=chunks, checkpoint="never", schedule=name)
             for name, w in works.items()}
    timelines: dict[str, list[Timeline]] = {name: [] for name in SCHEDULES}

    def step(name: str) -> None:
        work, pipe = works[name], pipes[name]
        work.module.zero_grad(set_to_none=True)
        pipe.train_step(work.inputs, work.targets, work.loss_fn)
        assert pipe.timeline is not None
        timelines[name].append(pipe.timeline)

    time_rounds({name: (lambda name=name: step(name)) for name in SCHEDULES}, steps, warmup)
    rows = []
    for name in SCHEDULES:
        tls = timelines[name][warmup:]
        walls = [t.wall for t in tls]
        costs = costs_from_timeline(tls)
        actions = get_schedule(name, 2, chunks)
        pred = predict_step(actions, costs)
        median = statistics.median(walls)
        # each step replayed with its own action durations: the step without hand-overs and waits
        replayed = [predict_step(actions, costs, durations=durations_from_timeline(t)).step_time / t.wall
                    for t in tls]
        fig = plot_timeline(tls[-1], predicted=pred.timeline,
                            title=f"{name}, K=2, M={chunks}: measured (top) vs predicted (bottom)")
        fig.savefig(out / f"timeline_{name}_M{chunks}.png", dpi=110, metadata=figure_metadata())
        close_figure(fig)
        rows.append({
            "schedule": name, "chunks": chunks, "step_ms": median * 1e3,
            "step_ms_all": [w * 1e3 for w in walls],
            "predicted_ms": pred.step_time * 1e3,
            "prediction_error": (pred.step_time - median) / median,
            "replayed_over_measured": statistics.median(replayed),
            "measured_bubble": statistics.median(t.measured_bubble() for t in tls),
            "predicted_bubble": pred.bubble,
            "costs_ms": {k: [v * 1e3 for v in getattr(costs, k)]
                         for k in ("forward", "backward_input", "backward_weight", "transfer")},
        })
    return rows


def close_figure(fig: object) -> None:
    """Release a pyplot figure (``plot_timeline`` leaves it open)."""
    import matplotlib.pyplot as plt

    plt.close(fig)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=fresh_out(ROOT / "logs", "schedules"),
                        help="default: a fresh logs/schedules/<time>/; --out results/schedules replaces the "
                             "committed files")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=7, help="measured rounds per M")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--emulated-steps", type=int, default=3, help="measured rounds per emulated (K, M)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    progress = Progress(len(args.chunks), "bench_schedules", note=f"writing to {args.out}")
    for m in args.chunks:
        rows += bench_chunks(m, args.steps, args.warmup, args.out)
        progress.done(f"every schedule at M={m}")
    print(f"{'M':>3} {'schedule':>8} {'step ms':>9} {'pred ms':>9} {'err':>7} {'replay':>7} {'bubble':>7} "
          f"{'vs 1f1b':>8}")
    for m in args.chunks:
        base = next(r["step_ms"] for r in rows if r["chunks"] == m and r["schedule"] == "1f1b")
        for r in (r for r in rows if r["chunks"] == m):
            r["speedup_vs_1f1b"] = base / r["step_ms"]
            print(f"{m:>3} {r['schedule']:>8} {r['step_ms']:9.1f} {r['predicted_ms']:9.1f} "
                  f"{r['prediction_error']:+7.1%} {r['replayed_over_measured']:7.3f} {r['measured_bubble']:7.1%} "
                  f"{r['speedup_vs_1f1b']:7.3f}x")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
            "command": command_line(), **machine_info("cpu"),
            "machine": platform.machine(), "cpus": torch.get_num_threads(),
            "model": "8 x (Linear 512-2048, GELU, Linear 2048-512)", "batch": 1024, "K": 2,
            "checkpoint": "never", "steps": args.steps, "warmup": args.warmup}
    emulated = emulated_rows(args.emulated_steps, 1, args.out)
    (args.out / "emulated.md").write_text(markdown(emulated, command_line()))
    (args.out / "schedules.json").write_text(json.dumps({"meta": meta, "rows": rows, "emulated": emulated}, indent=2))
    print(f"wrote {args.out / 'schedules.json'}, emulated.md and timeline PNGs")


if __name__ == "__main__":
    main()

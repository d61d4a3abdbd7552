"""Overhead breakdown of a K=2 pipeline step (paper §3.1): recompute, bubble, imbalance, hand-over.

    python -m experiments.overheads              # results/overheads.md + overheads_timeline_*.png
    python -m experiments.overheads --tiny --out /tmp/ov
    python -m experiments.overheads experiment.chunks=[8] experiment.workloads.transformer.batch=32
    gpipe-train -m experiment=paper_overheads pipeline.chunks=4,32
    python -m experiments.overheads --from-multirun logs/train/multiruns/<time>   # bubble + imbalance only

Settings (workloads, K, the M list, timed steps) are the ``experiment`` block of
``conf/experiment/paper_overheads.yaml``.

Measured on K CPU stages (one thread each) from the engine's timeline: each
stage's events F, B, R (recompute) and ``wait`` (blocked on the neighbour).
Shares are of the total stage-time K x wall:
- recompute = time in R / (K wall);
- bubble (measured) = 1 - busy / (K wall), beside (K-1)/(M+K-1) and the simulator's;
- load imbalance = 1 - mean(busy) / max(busy) (the paper: 3.2% with two partitions);
- hand-over = median delay between a neighbour finishing and the dependent action
  starting (thread wake-up; no copies between CPU stages), times the hops on the
  critical path, / wall;
- weight update = one RMSProp step / (step + update).
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/overheads.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import dataclasses
import shutil
from pathlib import Path

import torch

from experiments.common import configs, log_wandb, parser, run_main, save_figure, write
from experiments.multirun import load_runs, run_dirs_note
from experiments.throughput_lib import (
    SIMULATOR_TEXT,
    engine_overhead,
    error,
    hop_seconds,
    simulator_findings,
    timed_cost_model,
    uncontended,
)
from gpipe_lab.app.config.experiments import workload_of
from gpipe_lab.bench import Progress
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table
from gpipe_lab.bench.step_timing import measure_step
from gpipe_lab.pipeline.measuring.call_timing import time_call
from gpipe_lab.planner.cost_model import CostModel
from gpipe_lab.planner.workload import WorkloadSpec
from gpipe_lab.plotting.timeline import plot_timeline

EXPERIMENT = "paper_overheads"
#: ``--tiny``: toy networks (Table 2's tiny ones), one timed step.
TINY = {EXPERIMENT: [
    "model.num_layers=3", "model.num_filters=8", "data.batch_size=64", "data.num_train=640",
    "experiment.steps=1", "experiment.repeat=1",
    "experiment.workloads.transformer.batch=32", "experiment.workloads.transformer.sizes={num_layers:8,"
    "d_model:32,ffn_dim:64,num_heads:2,vocab_size:64,seq_len:8,dropout:0.0}"]}


def update_seconds(model: torch.nn.Module) -> float:
    """Seconds of one RMSProp step over the model's parameters (gradients set to ones)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one stage runs it; two threads thrash on a shared 2-core machine
    try:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
        return time_call(opt.step, repeats=1, warmup=1).median
    finally:
        torch.set_num_threads(threads)


def workload_cost(work: WorkloadSpec, chunks: list[int], repeat: int, overhead: float) -> CostModel:
    """The simulator's cost model of ``work``, fitted once from per-layer times at every M's micro-batch
    (alone and beside a second stage)."""
    return timed_cost_model(work, [work.batch // m for m in chunks], repeat, overhead, 0.0)


def breakdown(work: WorkloadSpec, chunks: int, steps: int, cost: CostModel, out: Path, k: int = 2,
              ) -> tuple[dict, Path]:
    """One row of shares for ``work`` at K=``k``, M=``chunks`` (simulated with ``cost`` and the step's own
    hand-over delay), and its timeline picture."""
    seconds, tl, balance = measure_step(work, k, chunks, steps)
    busy, wall = tl.busy(), tl.wall
    total = k * wall
    hop = hop_seconds(tl)
    pred = dataclasses.replace(cost, handover=hop).predict(balance, chunks, work.batch)
    sim_s, sim_tl = pred.step_time, pred.timeline
    alone_s = uncontended(dataclasses.replace(cost, handover=hop)).predict(balance, chunks, work.batch).step_time
    hops_on_path = 2 * (chunks + k - 1)  # fill and drain each cross the boundaries once per micro-batch + ends
    update = update_seconds(work.model())
    row = {"workload": work.name, "K": k, "M": chunks, "balance": balance, "wall_s": wall,
           "recompute": tl.time_in("R") / total, "forward": tl.time_in("F") / total,
           "backward": tl.time_in("B") / total, "wait": tl.time_in("wait") / total,
           "bubble_measured": tl.measured_bubble(), "bubble_theory": (k - 1) / (chunks + k - 1),
           "bubble_simulated": sim_tl.measured_bubble(), "imbalance": 1 - (sum(busy) / k) / max(busy),
           "handover_ms": hop * 1e3, "handover_share": min(1.0, hop * hops_on_path / wall),
           "update_share": update / (seconds + update), "simulated_wall_s": sim_s,
           "sim_error": error(sim_s, wall), "sim_alone_error": error(alone_s, wall)}
    png = out / f"overheads_timeline_{work.name}_m{chunks}.png"
    fig = plot_timeline(tl, title=f"{work.name} analogue, K={k}, M={chunks}: measured (top) vs simulated",
                        predicted=sim_tl)
    save_figure(fig, png, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return row, png


def findings(rows: list[dict]) -> str:
    """Sentences computed from the rows: where the measured bubble sits against theory, and the
    simulator's largest error."""
    bubbles = [r for r in rows if r.get("bubble_measured") is not None and r.get("bubble_theory") is not None]
    above = sum(r["bubble_measured"] > r["bubble_theory"] for r in bubbles)
    lines = [f"- Measured bubble above theory in {above} of {len(bubbles)} rows, below it in "
             f"{len(bubbles) - above}."]
    simulated = [r for r in rows if r.get("sim_error") is not None]
    if simulated:
        lines.append(simulator_findings(simulated, label="measured rows"))
    return "\n".join(lines)


def collected(dirs: list[Path], out: Path) -> tuple[list[dict], list[Path], str]:
    """Rows from gpipe-train jobs of ``paper_overheads`` under ``dirs`` (bubble, imbalance; the shares
    that need the engine's event timeline are None) and each job's last-step timeline picture."""
    runs = load_runs(dirs, [EXPERIMENT])
    rows, images = [], []
    for run in runs:
        s, busy = run.summary, run.summary.get("stage_busy_s") or []
        rows.append({"workload": f"{run.get('model.name')} ({run.path.name})", "K": s.get("K"), "M": s.get("M"),
                     "balance": s.get("balance"), "bubble_measured": s.get("bubble_measured"),
                     "bubble_theory": s.get("bubble_theory"),
                     "imbalance": 1 - sum(busy) / len(busy) / max(busy) if busy and max(busy) else None,
                     "samples_per_s": s.get("samples_per_s"), "job": str(run.path)})
        if (run.path / "timeline_last.png").exists():
            images.append(out / f"overheads_timeline_job{run.path.name}_m{s.get('M')}.png")
            shutil.copyfile(run.path / "timeline_last.png", images[-1])
    text = (f"{run_dirs_note(dirs, runs)} Bubble and load imbalance from each job's summary.json (means over "
            "its steps after the first, through Lightning and GPipeStrategy); recompute, hand-over and "
            "weight-update shares need the engine's event timeline: `python -m experiments.overheads`.")
    return rows, images, text


def main() -> None:
    """Write ``overheads.md`` / ``.json`` and the timeline pictures under ``--out``.

    Raises:
        ValueError: a bad override (naming it).
    """
    args = parser(__doc__.split("\n")[0], [EXPERIMENT], multirun=True).parse_args()
    e = configs(args, [EXPERIMENT], TINY)[EXPERIMENT].experiment
    args.out.mkdir(parents=True, exist_ok=True)
    rows, images = [], []
    if args.from_multirun:
        rows, images, text = collected(args.from_multirun, args.out)
    else:
        text = (f"Shares of the total stage-time (K x wall) from the engine's measured timeline on {e.partitions} "
                "CPU stages (one thread each), checkpoint `except_last`, FLOPs balance; models = Table 2's CPU "
                "analogues. Wall-clock figures: the load average at generation time is in the provenance line; "
                f"rerun on a quiet machine before quoting. {SIMULATOR_TEXT} "
                f"Settings: `conf/experiment/{EXPERIMENT}.yaml`.")
        overhead = engine_overhead()
        progress = Progress(len(e.workloads) * (1 + len(e.chunks)), "overheads", note=f"writing to {args.out}")
        for label, block in e.workloads.items():
            work = workload_of(block, str(label))
            cost = workload_cost(work, list(e.chunks), e.repeat, overhead)
            progress.done(f"{label}: per-layer times for the simulator")
            for m in e.chunks:
                row, png = breakdown(work, m, e.steps, cost, args.out, e.partitions)
                rows.append(row)
                images.append(png)
                progress.done(f"{label} M={m}")

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    header = ["model", "M", "balance", "recompute", "bubble measured", "bubble theory", "bubble simulated",
              "load imbalance", "recorded waits (part of the bubble)", "hand-over (estimate)", "weight update", "step (s)",
              "simulated step (s)", "simulator error", "error without contention"]
    table = [[r["workload"], r["M"], r["balance"], pct(r.get("recompute")), pct(r["bubble_measured"]),
              pct(r["bubble_theory"]), pct(r.get("bubble_simulated")), pct(r["imbalance"]), pct(r.get("wait")),
              f"{pct(r['handover_share'])} ({r['handover_ms']:.2f} ms/hop)" if "handover_ms" in r else "-",
              pct(r.get("update_share")), f"{r['wall_s']:.3f}" if "wall_s" in r else "-",
              f"{r['simulated_wall_s']:.3f}" if "simulated_wall_s" in r else "-",
              f"{r['sim_error']:+.1%}" if r.get("sim_error") is not None else "-",
              f"{r['sim_alone_error']:+.1%}" if r.get("sim_alone_error") is not None else "-"] for r in rows]
    paper = [["paper (TPU, §3.1)", "-", "-", "up to 23%", "slightly below theory", "(K-1)/(M+K-1)", "-",
              "3.2% (K=2)", "-", "small (only boundary activations cross)", "small", "-", "-", "-", "-"]]
    pics = "\n".join(f"![{p.stem}]({p.name})" for p in images)
    ks = sorted({r["K"] for r in rows})
    md = [f"# Overheads of a K={', '.join(map(str, ks))} pipeline step", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}{text}", "", md_table(header, paper + table), "",
          findings(rows), "", pics, ""]
    path = write(args.out, "overheads.md", "\n".join(md), rows)
    log_wandb(args.wandb, args.out, "overheads", {"overheads": (header, table)}, images)
    print(path)


if __name__ == "__main__":
    run_main(main)

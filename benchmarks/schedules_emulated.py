"""The V-shaped schedules beside 1F1B and ZB-H1/H2 on emulated devices (K = 2, 4, 8): bubble against theory.

Part of ``benchmarks.bench_schedules`` (its ``emulated`` rows). Every stage sleeps instead of
computing (``gpipe_lab.bench.emulated``, ``weight_share=0.5``), so eight ranks fit two cores and
F = B = W for every chunk: the condition under which the zero-bubble schedules are meant to be
zero bubble. The model is ``LAYERS`` equal emulated layers, one micro-batch's forward through all
of them taking ``FORWARD_MS``; one-stage schedules cut it into K stages, the V-shaped ones into 2K
(rank r holds stages r and 2K-1-r). Per (K, M, schedule): the engine's measured bubble (idle
share of the step's own timeline, median over steps) beside the theory: the bubble of the same
action lists on the simulator at the nominal costs (F = B = W, no hand-over time), which for 1F1B
is (K-1)/(M+K-1) and for ZB-H1 (K-1)/(3M+K-1) (``closed_form``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from gpipe_lab.bench.emulated import balanced, emulated_module
from gpipe_lab.pipeline import GPipe, Timeline
from gpipe_lab.pipeline.measuring.call_timing import time_rounds
from gpipe_lab.pipeline.schedules import schedule_placement
from gpipe_lab.planner.simulator import unit_cost_bubble
from gpipe_lab.planner.workload import mse

SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2))  # (name, v)
RANKS = (2, 4, 8)
LAYERS = 16
FORWARD_MS = 64.0  # one micro-batch through every layer
BATCH = 64


def closed_form(name: str, K: int, M: int) -> float | None:
    """The textbook bubble at F = B = W (None where this lab states none)."""
    if name == "1f1b":
        return (K - 1) / (M + K - 1)
    if name == "zb-h1":
        return (K - 1) / (3 * M + K - 1)
    return None


def bench_emulated(K: int, chunks: int, steps: int, warmup: int, out: Path | None = None) -> list[dict]:
    """One row per schedule at K ranks and M=``chunks``: the measured bubble beside the theory."""
    per_sample = FORWARD_MS / 1e3 / LAYERS / (BATCH / chunks)  # a layer's forward of one micro-batch: FORWARD_MS/LAYERS
    x, y = torch.randn(BATCH, 1), torch.randn(BATCH, 1)
    pipes, modules = {}, {}
    for name, v in SCHEDULES:
        modules[name] = emulated_module([per_sample] * LAYERS, backward_ratio=2.0, weight_share=0.5)
        pipes[name] = GPipe(modules[name], balance=balanced(LAYERS, K * v), chunks=chunks, checkpoint="never",
                            schedule=name, virtual_stages=v, threads_per_stage=1, seed=0)
    timelines: dict[str, list[Timeline]] = {name: [] for name, _ in SCHEDULES}

    def step(name: str) -> None:
        modules[name].zero_grad(set_to_none=True)
        pipes[name].train_step(x, y, mse)
        assert pipes[name].timeline is not None
        timelines[name].append(pipes[name].timeline)

    time_rounds({name: (lambda name=name: step(name)) for name, _ in SCHEDULES}, steps, warmup)
    rows = []
    for name, v in SCHEDULES:
        tls = timelines[name][warmup:]
        if out is not None and name in ("zb-v", "dualpipev") and K == 4 and chunks == 2 * K:
            save_timeline(tls[-1], out / f"timeline_{name}_K{K}_M{chunks}_emulated.png",
                          f"{name}, K={K} (2 stages per rank, V placement), M={chunks}, emulated devices")
        rows.append({
            "schedule": name, "K": K, "chunks": chunks, "virtual_stages": v,
            "placement": list(schedule_placement(name, K, v)),
            "step_ms": statistics.median(t.wall for t in tls) * 1e3,
            "measured_bubble": statistics.median(t.measured_bubble() for t in tls),
            "theory_bubble": unit_cost_bubble(name, K, chunks, v),
            "closed_form": closed_form(name, K, chunks),
        })
    return rows


def save_timeline(timeline: Timeline, path: Path, title: str) -> None:
    """One measured step's timeline as a PNG."""
    import matplotlib.pyplot as plt

    from gpipe_lab.bench.machine import figure_metadata
    from gpipe_lab.plotting import plot_timeline

    fig = plot_timeline(timeline, title=title)
    fig.savefig(path, dpi=110, metadata=figure_metadata())
    plt.close(fig)  # type: ignore[arg-type]


def markdown(rows: list[dict], command: str) -> str:
    """``emulated.md``: the rows as a table, with how they were made."""
    from gpipe_lab.bench.markdown import md_table

    def pct(value: float | None) -> str:
        return "" if value is None else f"{value:.1%}"

    table = md_table(["K", "M", "schedule", "stages per rank", "step ms", "measured bubble", "theory (simulator)",
                      "closed form"],
                     [[r["K"], r["chunks"], r["schedule"], r["virtual_stages"], f"{r['step_ms']:.0f}",
                       pct(r["measured_bubble"]), pct(r["theory_bubble"]), pct(r["closed_form"])] for r in rows])
    return (f"# Schedules on emulated devices: bubble against theory\n\n`{command}` (the `emulated` rows of "
            f"`schedules.json`).\n\n{__doc__.split(chr(10), 2)[2].strip()}\n\n{table}\n")


def emulated_rows(steps: int, warmup: int, out: Path | None = None) -> list[dict]:
    """Every (K, M) of ``RANKS`` x {2K, 4K}, printed as it goes."""
    rows = []
    print(f"{'K':>2} {'M':>3} {'schedule':>10} {'step ms':>8} {'bubble':>7} {'theory':>7}")
    for K in RANKS:
        for M in (2 * K, 4 * K):
            for r in bench_emulated(K, M, steps, warmup, out):
                rows.append(r)
                print(f"{K:>2} {M:>3} {r['schedule']:>10} {r['step_ms']:8.1f} {r['measured_bubble']:7.1%} "
                      f"{r['theory_bubble']:7.1%}")
    return rows

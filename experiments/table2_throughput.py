"""Table 2: normalized training throughput against K and M, beside the paper (TPU).

    python -m experiments.table2_throughput              # results/table2_throughput.md (+ .png)
    python -m experiments.table2_throughput --tiny --out /tmp/t2
    python -m experiments.table2_throughput --experiment paper_table2_amoebanet experiment.chunks=[1,4]
    gpipe-train -m experiment=paper_table2_amoebanet pipeline.partitions=1,2 pipeline.chunks=1,4,32
    python -m experiments.table2_throughput --from-multirun logs/train/multiruns/<time>

The workloads and the K / M grid are the ``experiment`` blocks of
``conf/experiment/paper_table2_{amoebanet,transformer}.yaml``. Three kinds of cell:
K in ``measured_k`` run for real on CPU stages (GPipe, one thread per stage, local
transport); K in ``experiment.emulated_k`` (default 1, 2, 4, 8) run the real engine on
emulated devices, layers that sleep their share of the per-layer FLOPs
(``experiment.emulated_forward_ms`` per mini-batch forward, default 1600); every K is
simulated by the planner's simulator from one ``CostModel`` fitted per workload
(fixed + per-sample per layer from per-layer times at every M's micro-batch size, the
engine's per-action overhead, the hand-over measured at K = 2). The simulator's error
is printed for every measured and emulated cell, and every cell where emulated and
simulated differ by more than 5% is listed with its reason. On a machine with K GPUs
``--gpu`` measures each K with ``cuda:0..K-1`` (not exercised here: no GPU).
``--from-multirun`` builds the table from gpipe-train runs (their ``summary.json``
samples/s) instead of measuring.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/table2_throughput.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
from pathlib import Path
from typing import Any

from experiments.common import log_wandb, panel_figure, run_main, throughput_rows_from_command_line, write
from experiments.multirun import JOB_HEADER, f2, jobs_table
from experiments.table2_multirun import EXPERIMENTS, NAMES, PAPER, multirun_table, paper, pipelining_gains
from experiments.throughput_grid import run_grids
from experiments.throughput_lib import (
    SIMULATOR_TEXT,
    emulation_settings,
    simulator_findings,
    tiny_overrides,
)
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table

#: ``--tiny``: toy networks, one timed step.
TINY = tiny_overrides(*EXPERIMENTS)


def normalized(rows: list[dict], key: str) -> dict[tuple[str, int, int], float]:
    """Mean ``key`` of every (workload, K, M) (repeated jobs averaged) divided by that workload's K=2, M=1."""
    groups: dict[tuple[str, int, int], list[float]] = {}
    for r in rows:
        if r.get(key):
            groups.setdefault((r["workload"], r["K"], r["M"]), []).append(r[key])
    means = {cell: sum(v) / len(v) for cell, v in groups.items()}
    base = {w: v for (w, k, m), v in means.items() if (k, m) == (2, 1)}
    return {(w, k, m): v / base[w] for (w, k, m), v in means.items() if w in base}


def plot(rows: list[dict], path: Path, ms: list[int], ks: list[int]) -> Path:
    """Normalized throughput against M, one line per K (ours) with the paper's dashed."""
    series = {kind: normalized(rows, f"{kind}_sps") for kind in ("measured", "emulated", "simulated")}
    styles = {"measured": "o-", "emulated": "^-", "simulated": "x:"}

    def draw(ax: Any, name: str) -> None:
        for i, k in enumerate(ks):
            color = f"C{i}"
            for kind, values in series.items():
                pts = [(m, values[(name, k, m)]) for m in ms if (name, k, m) in values]
                if pts:  # a kind with no cell at this K draws no empty series
                    ax.plot(*zip(*pts), styles[kind], color=color, label=f"K={k} {kind}")
            if k in (2, 4, 8):
                pm = [m for m in ms if (name, m) in PAPER]
                ax.plot(pm, [PAPER[(name, m)][(2, 4, 8).index(k)] for m in pm], "s--", color=color, alpha=0.6,
                        label=f"K={k} paper")

    labels = [n for n in NAMES if any(r["workload"] == n for r in rows)]
    return panel_figure(path, labels, NAMES, draw, "micro-batches M", "throughput / (K=2, M=1)", (5, 4))


def cell(meas: dict, sim: dict, key: tuple[str, int, int], kind: str, measured_k: bool) -> str:
    """A normalized cell: the measured value, or the simulated one (measured with ``--gpu`` when there is one)."""
    if kind in ("measured", "emulated"):
        return f2(meas.get(key))
    if not measured_k and key in meas:
        return f2(meas[key], " (measured)")
    return f2(sim.get(key))


def disagreements(grid: list[dict], emu: dict, sim: dict, threshold: float = 0.05) -> list[str]:
    """One line per cell where the emulated and the simulated normalized throughput differ by more than
    ``threshold``, with the parts the numbers give: the engine's own cost (the emulated step against its
    exact-cost simulation), the contention between CPU stage threads (the simulated step with and without
    it), and the rest, the costs themselves (emulated layers cost their FLOPs, simulated ones their CPU
    times)."""
    lines = []
    for r in grid:
        key = (r["workload"], r["K"], r["M"])
        if key not in emu or key not in sim or abs(sim[key] / emu[key] - 1) <= threshold:
            continue
        parts = []
        if r.get("emulated_sim_s"):
            parts.append(f"the engine adds {r['emulated_s'] / r['emulated_sim_s'] - 1:+.0%} to the emulated step "
                         "over its exact-cost simulation")
        if r.get("simulated_alone_s") and r["K"] > 1:
            parts.append(f"contention between CPU stage threads adds {r['simulated_s'] / r['simulated_alone_s'] - 1:+.0%}"
                         " to the simulated step")
        parts.append("the rest is the costs: emulated layers cost their FLOPs, the simulated ones their CPU "
                     "times (fixed per-call costs weigh on small micro-batches)")
        lines.append(f"- {key[0]} K={key[1]} M={key[2]}: emulated {emu[key]:.2f} vs simulated {sim[key]:.2f} "
                     f"({sim[key] / emu[key] - 1:+.0%}); {'; '.join(parts)}.")
    return lines


def measured_table(args: argparse.Namespace, cfgs: dict) -> tuple[list[dict], list[str], list[list[object]], str]:
    """Run the configured grids; returns rows, the table, and the markdown describing it."""
    rows, header, table, notes = [], None, [], []
    works = []
    for e, work, grid in run_grids(cfgs.values(), Path(__file__).stem, args.gpu, f"writing to {args.out}"):
        works.append(work)
        emulated_k, emulated_ms = emulation_settings(e)
        rows += grid
        meas, sim = normalized(grid, "measured_sps"), normalized(grid, "simulated_sps")
        emu = normalized(grid, "emulated_sps")
        ks = sorted({*e.measured_k, *e.simulated_k, *emulated_k} - {1})
        cols = [(k, kind) for k in ks for kind, ks_of in (("measured", e.measured_k), ("emulated", emulated_k),
                                                          ("simulated", ks)) if k in ks_of]
        mine = ["model (ours)", "M", *(f"K={k} {kind}" for k, kind in cols), "paper K=2", "paper K=4", "paper K=8"]
        if header is not None and mine != header:
            raise ValueError(f"the configs' K grids differ ({header[2:-3]} vs {mine[2:-3]}): give "
                             "experiment.measured_k / simulated_k once for all, or run one --experiment at a time")
        header = mine
        of_kind = {"measured": meas, "emulated": emu, "simulated": meas}
        for m in e.chunks:
            cells = [cell(of_kind[kind], sim, (work.name, k, m), kind, k in e.measured_k) for k, kind in cols]
            table.append([f"{NAMES[work.name]} analogue", m, *cells, *paper(work.name, m)])
        notes += disagreements(grid, emu, sim)
    sizes = "; ".join(f"{w.name}: `{w.preset}` {w.sizes}, mini-batch {w.batch}" for w in works)
    text = (f"Throughput = samples/s, normalized to K=2, M=1 of the same kind (measured / emulated / simulated). "
            f"Ours: CPU analogues at sizes this 2-core CPU can run ({sizes}); fixed mini-batch for every M; "
            "checkpoint `except_last`. *Measured*: CPU stages with one thread each (wall-clock: rerun on a "
            "quiet machine before quoting). *Emulated*: the real engine on emulated devices, layers that sleep "
            f"their share of the per-layer FLOPs (mini-batch forward {emulated_ms:g} ms, backward 2x). "
            f"{SIMULATOR_TEXT} Settings: {', '.join(f'`conf/experiment/{n}.yaml`' for n in cfgs)}.")
    text += ("\n\nEmulated and simulated cells more than 5% apart:\n\n" + "\n".join(notes)) if notes else \
        "\n\nEvery emulated cell is within 5% of the simulated one."
    return rows, header or [], table, text


def validation_table(rows: list[dict]) -> tuple[list[str], list[list[object]]]:
    """Every measured and every emulated cell beside the simulator's step and its error."""
    header = ["model", "K", "M", "kind", "balance", "step s", "simulated s/step", "error",
              "error without contention", "bubble", "simulated bubble", "theory (K-1)/(M+K-1)"]
    table = []
    for r in rows:
        theory = f"{(r['K'] - 1) / (r['M'] + r['K'] - 1):.3f}"
        if r["measured_s"]:
            alone = r.get("sim_alone_error")
            table.append([r["workload"], r["K"], r["M"], "measured (CPU)", r["balance"], f"{r['measured_s']:.3f}",
                          f"{r['simulated_s']:.3f}", f"{r['sim_error']:+.1%}",
                          "-" if alone is None or r["K"] == 1 else f"{alone:+.1%}", f"{r['measured_bubble']:.3f}",
                          f"{r['simulated_bubble']:.3f}", theory])
        if r.get("emulated_s"):
            table.append([r["workload"], r["K"], r["M"], "emulated", r["balance"], f"{r['emulated_s']:.3f}",
                          f"{r['emulated_sim_s']:.3f}", f"{r['emulated_error']:+.1%}", "-",
                          f"{r['emulated_bubble']:.3f}", "-", theory])
    return header, table


def main() -> None:
    """Measure (or collect), and write ``table2_throughput.md`` / ``.json`` / ``.png`` under ``--out``.

    Raises:
        ValueError: a bad override, an unknown experiment, or a multirun folder without paper_table2_* jobs.
    """
    args, (rows, header, table, text) = throughput_rows_from_command_line(
        __doc__.split("\n")[0], EXPERIMENTS, TINY, multirun_table, measured_table)
    ms = sorted({r["M"] for r in rows})
    ks = sorted({r["K"] for r in rows if r["K"] != 1})
    png = plot(rows, args.out / "table2_throughput.png", ms, ks)
    md = ["# Table 2 — normalized training throughput (K partitions, M micro-batches)", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}{text}", "",
          md_table(header, table), "", "![throughput vs M](table2_throughput.png)", ""]
    tables = {"throughput": (header, table)}
    if not args.from_multirun:
        v_header, validation = validation_table(rows)
        md += ["## Simulator against measurement (the same run's per-layer times; emulated: exact costs)", "",
               simulator_findings(rows), simulator_findings(rows, "emulated_error", None, "emulated cells"), "",
               md_table(v_header, validation), ""]
        tables["validation"] = (v_header, validation)
    else:
        jobs = jobs_table(rows)
        md += [*pipelining_gains(rows), "", "## The jobs", "", md_table(JOB_HEADER, jobs), ""]
        tables["jobs"] = (JOB_HEADER, jobs)
    data = [{k: v for k, v in r.items() if "timeline" not in k} for r in rows]
    path = write(args.out, "table2_throughput.md", "\n".join(md), data)
    log_wandb(args.wandb, args.out, "table2_throughput", tables, [png])
    print(path)


if __name__ == "__main__":
    run_main(main)

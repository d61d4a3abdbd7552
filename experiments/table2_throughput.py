"""Table 2: normalized training throughput against K and M, beside the paper (TPU).

    python -m experiments.table2_throughput              # results/table2_throughput.md (+ .png)
    python -m experiments.table2_throughput --tiny --out /tmp/t2
    python -m experiments.table2_throughput --experiment paper_table2_amoebanet experiment.chunks=[1,4]
    gpipe-train -m experiment=paper_table2_amoebanet pipeline.partitions=1,2 pipeline.chunks=1,4,32
    python -m experiments.table2_throughput --from-multirun logs/train/multiruns/<time>

The workloads and the K / M grid are the ``experiment`` blocks of
``conf/experiment/paper_table2_{amoebanet,transformer}.yaml``. K in ``measured_k``
run for real on CPU stages (GPipe, one thread per stage, local transport). K in
``simulated_k`` cannot run in parallel on 2 cores: they are predicted by the
planner's simulator from per-layer forward / backward / recompute times measured
here on one thread at the same micro-batch size, summed over the balance the engine
gets (by per-layer FLOPs, as Lingvo), with the stage hand-over delay measured at
K = 2. On a machine with K GPUs ``--gpu`` measures each K with ``cuda:0..K-1`` (not
exercised here: no GPU). ``--from-multirun`` builds the table from gpipe-train runs
(their ``summary.json`` samples/s) instead of measuring.
"""

from __future__ import annotations

if not __package__:  # run as a file, ``python experiments/table2_throughput.py``: rerun as the module, from the root
    import os
    import sys

    os.execv(sys.executable, [sys.executable, "-m", "experiments.table2_throughput", *sys.argv[1:]])

import argparse
import sys
from pathlib import Path

from experiments.common import log_wandb, md_table, provenance, throughput_rows_from_command_line, write
from experiments.multirun import JOB_HEADER, f2, jobs_table, load_runs, run_dirs_note, throughput_rows
from experiments.throughput_lib import run_grid, tiny_overrides, workload_of

PAPER = {  # (model, M) -> K=2, K=4, K=8
    ("amoeba", 1): (1, 1.13, 1.38), ("amoeba", 4): (1.07, 1.26, 1.72), ("amoeba", 32): (1.21, 1.84, 3.48),
    ("transformer", 1): (1, 1.07, 1.3), ("transformer", 4): (1.7, 3.2, 4.8), ("transformer", 32): (1.8, 3.4, 6.3)}
NAMES = {"amoeba": "AmoebaNet-D(18, 256)", "transformer": "Transformer-48"}
EXPERIMENTS = ["paper_table2_amoebanet", "paper_table2_transformer"]
#: ``--tiny``: toy networks, one timed step.
TINY = tiny_overrides(*EXPERIMENTS)


def normalized(rows: list[dict], key: str) -> dict[tuple[str, int, int], float]:
    """samples/s of every (workload, K, M) divided by that workload's K=2, M=1."""
    base = {r["workload"]: r[key] for r in rows if r["K"] == 2 and r["M"] == 1 and r[key]}
    return {(r["workload"], r["K"], r["M"]): r[key] / base[r["workload"]] for r in rows
            if r[key] and r["workload"] in base}


def paper(label: str, m: int) -> list[object]:
    """The paper's K=2, 4, 8 cells of this row ('-' for an M the paper did not run)."""
    return list(PAPER.get((label, m), ("-", "-", "-")))


def plot(rows: list[dict], path: Path, ms: list[int], ks: list[int]) -> Path:
    """Normalized throughput against M, one line per K (ours) with the paper's dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meas, sim = normalized(rows, "measured_sps"), normalized(rows, "simulated_sps")
    labels = [n for n in NAMES if any(r["workload"] == n for r in rows)]
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), squeeze=False)
    for ax, name in zip(axes[0], labels):
        for i, k in enumerate(ks):
            color = f"C{i}"
            ours = [meas.get((name, k, m), sim.get((name, k, m))) for m in ms]
            kind = "measured" if (name, k, ms[0]) in meas else "simulated"
            ax.plot(ms, ours, "o-", color=color, label=f"K={k} ours ({kind})")
            if k in (2, 4, 8):
                pm = [m for m in ms if (name, m) in PAPER]
                ax.plot(pm, [PAPER[(name, m)][(2, 4, 8).index(k)] for m in pm], "s--", color=color, alpha=0.6,
                        label=f"K={k} paper")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("throughput / (K=2, M=1)")
        ax.set_title(NAMES[name] + " (ours: CPU analogue)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cell(meas: dict, sim: dict, key: tuple[str, int, int], kind: str, measured_k: bool) -> str:
    """A normalized cell: the measured value, or the simulated one (measured with ``--gpu`` when there is one)."""
    if kind == "measured":
        return f2(meas.get(key))
    if not measured_k and key in meas:
        return f2(meas[key], " (measured)")
    return f2(sim.get(key))


def measured_table(args: argparse.Namespace, cfgs: dict) -> tuple[list[dict], list[str], list[list[object]], str]:
    """Run the configured grids; returns rows, the table, and the markdown describing it."""
    rows, header, table = [], None, []
    works = []
    for cfg in cfgs.values():
        e = cfg.experiment
        work = workload_of(e)
        works.append(work)
        grid = run_grid(work, list(e.measured_k), list(e.simulated_k), list(e.chunks), e.steps, e.repeat, args.gpu)
        rows += grid
        meas, sim = normalized(grid, "measured_sps"), normalized(grid, "simulated_sps")
        ks = sorted({*e.measured_k, *e.simulated_k} - {1})
        cols = [(k, "measured") for k in ks if k in e.measured_k]
        cols = sorted(cols + [(k, "simulated") for k in ks], key=lambda c: (c[0], c[1] != "measured"))
        mine = ["model (ours)", "M", *(f"K={k} {kind}" for k, kind in cols), "paper K=2", "paper K=4", "paper K=8"]
        if header is not None and mine != header:
            raise ValueError(f"the configs' K grids differ ({header[2:-3]} vs {mine[2:-3]}): give "
                             "experiment.measured_k / simulated_k once for all, or run one --experiment at a time")
        header = mine
        for m in e.chunks:
            cells = [cell(meas, sim, (work.name, k, m), kind, k in e.measured_k) for k, kind in cols]
            table.append([f"{NAMES[work.name]} analogue", m, *cells, *paper(work.name, m)])
    sizes = "; ".join(f"{w.name}: `{w.preset}` {w.sizes}, mini-batch {w.batch}" for w in works)
    text = (f"Throughput = samples/s, normalized to K=2, M=1 of the same kind (measured / simulated). "
            f"Ours: CPU analogues at sizes this 2-core CPU can run ({sizes}); fixed mini-batch for every M; "
            "checkpoint `except_last`. Measured K on CPU stages with one thread each (wall-clock: rerun on a "
            "quiet machine before quoting); the other K simulated from per-layer times. Settings: "
            f"{', '.join(f'`conf/experiment/{n}.yaml`' for n in cfgs)}.")
    return rows, header or [], table, text


def multirun_table(dirs: list[Path]) -> tuple[list[dict], list[str], list[list[object]], str]:
    """The table from gpipe-train jobs of ``paper_table2_*`` under ``dirs``."""
    runs = load_runs(dirs, EXPERIMENTS)
    rows = throughput_rows(runs)
    meas = normalized(rows, "measured_sps")
    ks = sorted({r["K"] for r in rows if r["K"] != 1} or {1})
    header = ["model (ours)", "M", *(f"K={k} gpipe-train" for k in ks), "paper K=2", "paper K=4", "paper K=8"]
    table = [[f"{NAMES[label]} analogue", m, *(f2(meas.get((label, k, m))) for k in ks), *paper(label, m)]
             for label in NAMES for m in sorted({r["M"] for r in rows if r["workload"] == label})]
    text = (f"{run_dirs_note(dirs, runs)} Throughput = `samples_per_s` of each job's summary.json (mean over "
            "the steps after the first, through Lightning and GPipeStrategy), normalized to K=2, M=1 of the "
            "same model ('-' where that job is missing). Wall-clock: rerun on a quiet machine before quoting.")
    return rows, header, table, text


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
        v_header = ["model", "K", "M", "balance", "measured s/step", "simulated s/step", "error",
                    "measured bubble", "simulated bubble", "theory (K-1)/(M+K-1)"]
        validation = [[r["workload"], r["K"], r["M"], r["balance"], f"{r['measured_s']:.3f}",
                       f"{r['simulated_s']:.3f}", f"{(r['simulated_s'] - r['measured_s']) / r['measured_s']:+.1%}",
                       f"{r['measured_bubble']:.3f}", f"{r['simulated_bubble']:.3f}",
                       f"{(r['K'] - 1) / (r['M'] + r['K'] - 1):.3f}"] for r in rows if r["measured_s"]]
        md += ["## Simulator validation: measured vs simulated step time", "", md_table(v_header, validation), ""]
        tables["validation"] = (v_header, validation)
    else:
        jobs = jobs_table(rows)
        md += ["## The jobs", "", md_table(JOB_HEADER, jobs), ""]
        tables["jobs"] = (JOB_HEADER, jobs)
    md += [Path(__file__).with_name("throughput_notes.md").read_text()] if not args.tiny and not args.from_multirun else []
    data = [{k: v for k, v in r.items() if "timeline" not in k} for r in rows]
    path = write(args.out, "table2_throughput.md", "\n".join(md), data)
    log_wandb(args.wandb, args.out, "table2_throughput", tables, [png])
    print(path)


if __name__ == "__main__":
    main()

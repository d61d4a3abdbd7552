"""What micro-batching costs this machine, and so what Table 2's K=2 can gain at each M here.

    gpipe-train -m experiment=paper_table2_amoebanet pipeline.partitions=1 pipeline.threads_per_stage=1 \
        pipeline.checkpoint=never,except_last pipeline.chunks=1,4,32 logger=csv hydra.sweep.dir=logs/mb_cost
    python -m experiments.microbatch_cost --from-multirun logs/mb_cost [more folders] --out results/sweeps

The paper's Table 2 rises with M because an accelerator runs a small micro-batch about as
efficiently per sample as a large one. Whether that holds here is measured, not assumed: the
unpipelined model (K=1) on one intra-op thread steps the same mini-batch as M micro-batches, with
and without re-materialization (``checkpoint=except_last``, Table 2's setting, recomputes M-1 of
them). From its samples/s s(M), two stages of exactly half the work each, on two free cores, with
no hand-over cost, fill and drain in (M+1)/(2M) of that step, so K=2 reaches at most
s(M) · 2M/(M+1) samples/s; at M=1 that is s(1). The ratio of the two is the most Table 2's K=2, M
cell can be against its K=2, M=1 cell on this machine (contention between the cores only lowers it).

Raises (as an error exit): a folder without finished K=1 jobs of ``paper_table2_*``.
"""

from __future__ import annotations

if not __package__:  # started as a file: rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
from pathlib import Path

from experiments.common import run_main, write
from experiments.multirun import load_runs, run_dirs_note
from experiments.table2_multirun import EXPERIMENTS, NAMES
from gpipe_lab.bench import md_table
from gpipe_lab.bench.machine import provenance


def cells(dirs: list[Path]) -> tuple[dict[tuple[str, str, int], list[float]], str]:
    """samples/s of each (model label, checkpoint mode, M) over the K=1, one-thread jobs under ``dirs``.

    Raises:
        ValueError: no such job under ``dirs``.
    """
    runs = load_runs(dirs, EXPERIMENTS)
    found: dict[tuple[str, str, int], list[float]] = {}
    for run in runs:
        s = run.summary
        if s.get("K") == 1 and s.get("threads_per_stage") == 1 and s.get("samples_per_s"):
            key = (str(run.get("experiment.label")), str(run.get("pipeline.checkpoint")), int(s["M"]))
            found.setdefault(key, []).append(float(s["samples_per_s"]))
    if not found:
        raise ValueError(f"no K=1 job on one intra-op thread (pipeline.partitions=1 pipeline.threads_per_stage=1) "
                         f"of {EXPERIMENTS} under {', '.join(map(str, dirs))}")
    return found, run_dirs_note(dirs, runs)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def rows(found: dict[tuple[str, str, int], list[float]]) -> list[dict[str, object]]:
    """One row per (model, checkpoint, M): samples/s, per-sample speed against M=1, K=2's most here."""
    out = []
    for (label, mode, m), values in sorted(found.items()):
        one = found.get((label, mode, 1))
        speed = mean(values) / mean(one) if one else None
        out.append({"model": label, "checkpoint": mode, "M": m, "samples_per_s": mean(values), "runs": len(values),
                    "vs_M1": speed, "k2_most_vs_M1": None if speed is None else speed * 2 * m / (m + 1)})
    return out


def findings(table: list[dict[str, object]]) -> list[str]:
    """Per model and mode: the most K=2 at each M > 1 can be against K=2, M=1 here, in words."""
    lines = []
    for label in NAMES:
        for mode in sorted({str(r["checkpoint"]) for r in table if r["model"] == label}):
            mine = [r for r in table if (r["model"], r["checkpoint"]) == (label, mode) and r["k2_most_vs_M1"] is not None
                    and int(r["M"]) > 1]  # type: ignore[call-overload]
            if not mine:
                continue
            below = [f"M={r['M']}" for r in mine if float(r["k2_most_vs_M1"]) < 1]  # type: ignore[arg-type]
            parts = ", ".join(f"M={r['M']}: {float(r['k2_most_vs_M1']):.2f}" for r in mine)  # type: ignore[arg-type]
            verdict = (f"below K=2, M=1 at {', '.join(below)} even before contention and hand-overs" if below
                       else "not below K=2, M=1 at any M measured")
            lines.append(f"- {NAMES[label]} analogue, checkpoint={mode}: K=2 can reach at most {parts} of its "
                         f"K=2, M=1 throughput here: {verdict}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from-multirun", nargs="+", type=Path, required=True, metavar="DIR",
                   help="gpipe-train -m folders holding K=1, one-thread jobs of paper_table2_*")
    p.add_argument("--out", type=Path, default=Path("results/sweeps"))
    args = p.parse_args(argv)
    found, note = cells(args.from_multirun)
    table = rows(found)
    header = ["model (ours)", "checkpoint", "M", "K=1 samples/s, one thread", "runs", "per-sample speed vs M=1",
              "K=2 at most, vs K=2 at M=1"]
    body = [[f"{NAMES.get(str(r['model']), r['model'])} analogue", r["checkpoint"], r["M"],
             f"{float(r['samples_per_s']):.1f}", r["runs"],  # type: ignore[arg-type]
             "-" if r["vs_M1"] is None else f"{float(r['vs_M1']):.2f}",  # type: ignore[arg-type]
             "-" if r["k2_most_vs_M1"] is None else f"{float(r['k2_most_vs_M1']):.2f}"]  # type: ignore[arg-type]
            for r in table]
    md = ["# What micro-batching costs this machine: the most Table 2's K=2 can gain at each M here", "",
          provenance(), "", note + " " + " ".join(__doc__.split("\n\n")[2].replace("``", "`").split()), "",
          md_table(header, body), "", *findings(table), ""]
    print(write(args.out, "microbatch_cost.md", "\n".join(md), {"rows": table}))
    return 0


if __name__ == "__main__":
    run_main(main)

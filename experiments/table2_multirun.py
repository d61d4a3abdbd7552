"""Table 2 from gpipe-train sweeps: repeated jobs of a cell averaged, normalized to K=2, M=1, and the
unpipelined job's comparison (threads and spread stated).

``multirun_table`` builds the table from the jobs' summary.json; ``pipelining_gains`` gives, per model,
K=2 at its fastest M against K=1, M=1, in samples/s and in the table's own normalization.
"""

from __future__ import annotations

from pathlib import Path

from experiments.multirun import load_runs, run_dirs_note, throughput_rows

PAPER = {  # (model, M) -> K=2, K=4, K=8
    ("amoeba", 1): (1, 1.13, 1.38), ("amoeba", 4): (1.07, 1.26, 1.72), ("amoeba", 32): (1.21, 1.84, 3.48),
    ("transformer", 1): (1, 1.07, 1.3), ("transformer", 4): (1.7, 3.2, 4.8), ("transformer", 32): (1.8, 3.4, 6.3)}
NAMES = {"amoeba": "AmoebaNet-D(18, 256)", "transformer": "Transformer-48"}
EXPERIMENTS = ["paper_table2_amoebanet", "paper_table2_transformer"]

def paper(label: str, m: int) -> list[object]:
    """The paper's K=2, 4, 8 cells of this row ('-' for an M the paper did not run)."""
    return list(PAPER.get((label, m), ("-", "-", "-")))


def repeats(rows: list[dict]) -> dict[tuple[str, int, int], list[dict]]:
    """The jobs of each (workload, K, M) that have a samples/s (repeats of one cell)."""
    groups: dict[tuple[str, int, int], list[dict]] = {}
    for r in rows:
        if r.get("measured_sps"):
            groups.setdefault((r["workload"], r["K"], r["M"]), []).append(r)
    return groups


def spread(jobs: list[dict], scale: float = 1.0) -> str:
    """Mean samples/s / ``scale`` of repeated jobs, with [min, max] and the count when more than one."""
    values = [r["measured_sps"] / scale for r in jobs]
    mean = sum(values) / len(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} [{min(values):.2f}, {max(values):.2f}] (n={len(values)})"


def mean_sps(jobs: list[dict]) -> float:
    """Mean samples/s of repeated jobs."""
    return sum(r["measured_sps"] for r in jobs) / len(jobs)


def multirun_table(dirs: list[Path]) -> tuple[list[dict], list[str], list[list[object]], str]:
    """The table from gpipe-train jobs of ``paper_table2_*`` under ``dirs``; repeated jobs of a cell are
    averaged (mean [min, max], n) and every cell is divided by the mean of its model's K=2, M=1 jobs."""
    runs = load_runs(dirs, EXPERIMENTS)
    rows = throughput_rows(runs)
    groups = repeats(rows)
    base = {label: mean_sps(groups[(label, 2, 1)]) for label in NAMES if (label, 2, 1) in groups}
    ks = sorted({r["K"] for r in rows})
    header = ["model (ours)", "M", *(f"K={k} gpipe-train" for k in ks), "paper K=2", "paper K=4", "paper K=8"]
    table = [[f"{NAMES[label]} analogue", m,
              *(spread(groups[(label, k, m)], base[label]) if (label, k, m) in groups and label in base else "-"
                for k in ks), *paper(label, m)]
             for label in NAMES for m in sorted({r["M"] for r in rows if r["workload"] == label})]
    text = (f"{run_dirs_note(dirs, runs)} Throughput = `samples_per_s` of each job's summary.json (mean over "
            "the steps after the first, through Lightning and GPipeStrategy), averaged over the repeated jobs of "
            "a cell (mean [min, max] (n) where there are several) and normalized to the mean of K=2, M=1 of the "
            "same model ('-' where that job is missing). Wall-clock: rerun on a quiet machine before quoting.")
    return rows, header, table, text


def pipelining_gains(rows: list[dict]) -> list[str]:
    """Per model: K=2 at its fastest M against the unpipelined job (K=1, M=1), from the jobs' samples/s
    (mean and range of the repeats, the threads each ran on), and both in the table's normalization."""
    lines, groups = [], repeats(rows)
    for label in NAMES:
        base = groups.get((label, 1, 1))
        pipelined = [jobs for (w, k, _), jobs in groups.items() if (w, k) == (label, 2)]
        if not base or not pipelined:
            continue
        best = max(pipelined, key=mean_sps)
        kind = "compiled stages" if all(r.get("compile") for r in [*base, *best]) else "eager stages"
        threads = [", ".join(str(t) for t in sorted({r["threads"] for r in jobs if r.get("threads")})) or "?"
                   for jobs in (best, base)]
        line = (f"- {NAMES[label]} analogue ({kind}): K=2 at its fastest M (M={best[0]['M']}, "
                f"{spread(best)} samples/s, {threads[0]} threads in all) is "
                f"{mean_sps(best) / mean_sps(base):.2f}x the unpipelined job (K=1, M=1, {spread(base)} samples/s, "
                f"{threads[1]} threads)")
        two = groups.get((label, 2, 1))
        if two:
            line += (f"; in the table's normalization (K=2, M=1 = 1.00) K=1, M=1 is "
                     f"{mean_sps(base) / mean_sps(two):.2f} and K=2, M={best[0]['M']} is "
                     f"{mean_sps(best) / mean_sps(two):.2f}")
        if threads[0] != threads[1] and "?" not in threads:
            line += "; the two ran on different thread counts, so the ratio mixes pipelining with threads"
        if min(len(base), len(best)) < 3:
            line += f"; fewer than 3 repeats ({len(base)} and {len(best)}): no spread to judge it by"
        lines.append(line + ".")
    return lines

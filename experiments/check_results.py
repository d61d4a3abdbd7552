"""Rerun a results table into a temporary folder and diff its deterministic columns against ``results/``.

    python -m experiments.check_results table1_capacity            # the full table (minutes)
    python -m experiments.check_results trainability --tiny --against tests/experiments/references
    python -m experiments.check_results table2_throughput overheads

Each name is an experiment script (``experiments/<name>.py``) writing ``<name>.md``.
The script runs with ``--out <temp>`` (and ``--tiny`` if given); every markdown
table of the fresh file is compared, table by table and row by row, with the same
table of ``--against``'s file (default ``results/``) on its deterministic columns:
every column except the wall-clock ones (headers naming a measured, emulated or
simulated time, a speed, a share of a step, a bubble seen in a step, an error or a
hand-over). Prose and the provenance line are not compared. Prints, per table, the
columns it compared and those it skipped; exits 1 and prints each difference when a
deterministic cell differs or a table changed shape.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/check_results.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.common import RESULTS
from gpipe_lab.bench.machine import ROOT
from gpipe_lab.bench.markdown import read_tables as tables

#: Headers of columns that depend on the machine's clock (never compared).
WALL_CLOCK = re.compile(r"measured|emulated|simulat|\bstep\b|s/step|samples/s|error|hand-over|wait|recompute|"
                        r"imbalance|update|seconds|\btime\b|tokens/s|speed|gap|excess|^bubble$", re.IGNORECASE)


def differences(fresh: str, reference: str, name: str = "") -> list[str]:
    """What differs between two files' tables on their deterministic columns (empty when they agree)."""
    out = []
    mine, theirs = tables(fresh), tables(reference)
    if len(mine) != len(theirs):
        return [f"{name}: {len(mine)} tables now, {len(theirs)} in the reference"]
    for t, ((head, rows), (ref_head, ref_rows)) in enumerate(zip(mine, theirs)):
        if head != ref_head or len(rows) != len(ref_rows):
            out.append(f"{name} table {t + 1}: shape changed ({len(head)} columns x {len(rows)} rows now, "
                       f"{len(ref_head)} x {len(ref_rows)} before; headers {head} vs {ref_head})")
            continue
        keep = [i for i, h in enumerate(head) if not WALL_CLOCK.search(h)]
        for r, (row, ref) in enumerate(zip(rows, ref_rows)):
            for i in keep:
                if i < len(row) and i < len(ref) and row[i] != ref[i]:
                    out.append(f"{name} table {t + 1} row {r + 1} [{head[i]}]: {row[i]!r} now, {ref[i]!r} before")
    return out


def compared_columns(markdown: str) -> list[tuple[list[str], list[str]]]:
    """Per table of ``markdown``: (the headers ``differences`` compares, the wall-clock headers it skips)."""
    return [([h for h in head if not WALL_CLOCK.search(h)], [h for h in head if WALL_CLOCK.search(h)])
            for head, _ in tables(markdown)]


def regenerate(name: str, out: Path, tiny: bool, timeout: float = 3600.0) -> Path:
    """Run ``experiments/<name>.py --out out`` (``--tiny``); returns the markdown it wrote.

    Raises:
        ValueError: no such experiment script.
        RuntimeError: the script failed (its stderr's tail in the message).
    """
    if not (ROOT / "experiments" / f"{name}.py").exists():
        allowed = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"no experiment script {name!r}; allowed: {', '.join(allowed)}")
    cmd = [sys.executable, "-m", f"experiments.{name}", "--out", str(out), *(["--tiny"] if tiny else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return out / f"{name}.md"


def main() -> None:
    """Regenerate each named table and print its differences; exit 1 if any."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="+", help="experiment scripts, e.g. table1_capacity trainability")
    p.add_argument("--tiny", action="store_true", help="regenerate at --tiny size")
    p.add_argument("--against", type=Path, default=RESULTS, help="folder of the reference files (results/)")
    args = p.parse_args()
    problems = []
    for name in args.names:
        with tempfile.TemporaryDirectory(prefix=f"check-{name}-") as tmp:
            fresh = regenerate(name, Path(tmp), args.tiny)
            reference = args.against / f"{name}.md"
            if not reference.exists():
                problems.append(f"{name}: no reference {reference}")
                continue
            found = differences(fresh.read_text(), reference.read_text(), name)
            print(f"{name}: {'agrees' if not found else f'{len(found)} differences'} on deterministic columns")
            for t, (kept, skipped) in enumerate(compared_columns(fresh.read_text())):
                print(f"  table {t + 1}: compared {kept or 'no column'}; skipped as wall-clock {skipped or 'none'}")
            problems += found
    for line in problems:
        print(line)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

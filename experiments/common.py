"""Shared helpers of the experiment scripts: arguments, provenance, markdown tables, wandb.

Every script takes ``--out DIR`` (where the markdown, JSON and PNG files go;
default ``results/``), ``--tiny`` (a seconds-long smoke run at toy sizes) and
``--wandb`` (also log the table and plots to an offline wandb run under DIR).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parser(description: str) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the common ``--out``, ``--tiny`` and ``--wandb`` options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=RESULTS, help="output directory (default: results/)")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run at toy sizes")
    p.add_argument("--wandb", action="store_true", help="log the table and plots to wandb (offline)")
    return p


def provenance(argv: Sequence[str] | None = None) -> str:
    """One markdown line: date, machine, torch version and the exact command."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(argv[0]) if argv else "?"
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f"_Generated {now} on {platform.node()} ({cpu}, {os.cpu_count()} CPU cores, {gpu}), "
            f"torch {torch.__version__}, by `python {shlex.join([script] + argv[1:])}`._")


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write(out: Path, name: str, markdown: str, data: object | None = None) -> Path:
    """Write ``name`` (markdown) and, with ``data``, ``name``'s JSON twin; returns the markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(markdown.rstrip() + "\n")
    if data is not None:
        path.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def log_wandb(enabled: bool, out: Path, name: str, tables: dict[str, tuple[Sequence[str], list]],
              images: Sequence[Path] = (), summary: dict[str, object] | None = None) -> None:
    """Log tables (name -> (columns, rows)), images and a summary to an offline wandb run.

    Does nothing unless ``enabled``. Raises ``ImportError`` if wandb is missing.
    """
    if not enabled:
        return
    import wandb

    run = wandb.init(project="gpipe-lab-paper", name=name, mode="offline", dir=str(out),
                     config={"argv": sys.argv}, reinit=True)
    try:
        for key, (columns, rows) in tables.items():
            run.log({key: wandb.Table(columns=list(columns), data=[[str(c) for c in r] for r in rows])})
        for image in images:
            run.log({image.stem: wandb.Image(str(image))})
        if summary:
            run.summary.update(summary)
    finally:
        run.finish()


def fmt_bytes(n: float, unit: str = "G") -> str:
    """Bytes in GiB (``G``) with two decimals."""
    return f"{n / 2**30:.2f}{unit}"


def fmt_count(n: float) -> str:
    """82M / 1.05B style parameter counts."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

"""Hydra callback: after a multirun, gather every job's ``summary.json`` into one table.

Writes ``<sweep dir>/summary.json`` (a list of rows) and ``summary.csv`` next to the job
folders, so experiment scripts can build tables without parsing logs.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def collect_summaries(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The ``summary.json`` rows of every job under ``sweep_dir`` (job folder order)."""
    rows = []
    for path in sorted(Path(sweep_dir).glob("*/summary.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        row = json.loads(path.read_text())
        row["job_dir"] = path.parent.name
        rows.append(row)
    return rows


def write_table(rows: list[dict[str, Any]], sweep_dir: str | Path) -> None:
    sweep_dir = Path(sweep_dir)
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    columns = sorted({k for row in rows for k in row})
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})


class SweepSummary(Callback):
    """``hydra.callbacks.sweep_summary`` in conf/hydra/default.yaml."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_summaries(sweep_dir)
        if rows:
            write_table(rows, sweep_dir)

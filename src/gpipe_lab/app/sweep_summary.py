"""Hydra callback: during and after a multirun, gather every job's ``summary.json`` into one table.

After each job (so a sweep whose later jobs fail keeps the table of those that finished) and at
the end of the sweep, writes next to the job folders ``summary.json`` (a list of rows), ``summary.csv`` and
``sweep_summary.md`` (one line per job: a column per key the sweep varies, then throughput, bubble,
memory, final metric), and, when
the logger is wandb, one more wandb run in the sweep's group (``job_type=sweep-summary``)
holding the same table as ``sweep/summary``. The sweep ends by printing where the table is.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gpipe_lab.bench.markdown import md_table

#: The table's columns: (header, summary.json key or a function of the row).
COLUMNS: list[tuple[str, Any]] = [
    ("job", "job_dir"), ("run", "run_name"), ("K", "K"), ("M", "M"), ("schedule", "schedule"),
    ("checkpoint", "checkpoint"), ("transport", "transport"), ("samples/s", "samples_per_s"),
    ("tokens/s", "tokens_per_s"), ("bubble", "bubble_measured"), ("bubble (theory)", "bubble_theory"),
    ("peak activation bytes", lambda r: max(r.get("stage_peak_activation_bytes") or [0]) or None),
    ("parameter bytes", lambda r: sum(r.get("stage_parameter_bytes") or [0]) or None),
    ("train loss", "final_train_loss"), ("metric", "validation_metric"), ("value", "validation_value"),
    ("test metric", "test_metric"), ("test value", "test_value"),
    ("commit", "commit"),
]


def collect_summaries(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The ``summary.json`` rows of every job under ``sweep_dir`` (job folder order)."""
    rows = []
    for path in sorted(Path(sweep_dir).glob("*/summary.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        row = json.loads(path.read_text())
        row["job_dir"] = path.parent.name
        rows.append(row)
    return rows


#: Swept keys whose values ``COLUMNS`` shows already.
SHOWN_KEYS = ("pipeline.partitions", "pipeline.chunks", "pipeline.schedule", "pipeline.checkpoint",
              "pipeline.transport")


def swept_columns(rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """A column per key the sweep varies (each job's ``swept`` values in its summary), in sweep order."""
    keys = dict.fromkeys(k for row in rows for k in (row.get("swept") or {}) if k not in SHOWN_KEYS)
    return [(key, lambda r, key=key: (r.get("swept") or {}).get(key)) for key in keys]


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The headers (``COLUMNS`` with the swept keys after the run name) and one list of values per job."""
    columns = [*COLUMNS[:2], *swept_columns(rows), *COLUMNS[2:]]
    headers = [name for name, _ in columns]
    data = [[key(row) if callable(key) else row.get(key) for _, key in columns] for row in rows]
    return headers, data


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_table(rows: list[dict[str, Any]], sweep_dir: str | Path) -> None:
    """``summary.json``, ``summary.csv`` (every key) and ``sweep_summary.md`` (``COLUMNS``)."""
    sweep_dir = Path(sweep_dir)
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    columns = sorted({k for row in rows for k in row})
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
    headers, data = table_rows(rows)
    table = md_table(headers, data, cell=_cell)
    (sweep_dir / "sweep_summary.md").write_text(f"# Sweep {sweep_dir.name}: {len(rows)} jobs\n\n{table}\n")


def log_wandb_table(rows: list[dict[str, Any]], sweep_dir: Path, logger: DictConfig) -> None:
    """One wandb run in the sweep's group holding the table (``logger``: the ``logger`` group)."""
    import wandb

    from gpipe_lab.app.wandb_run import console_settings, finish_and_flush

    headers, data = table_rows(rows)
    group = logger.get("group") or sweep_dir.name
    mode = logger.get("mode", "offline")
    run = wandb.init(dir=str(sweep_dir), project=logger.get("project"), entity=logger.get("entity"),
                     group=group, name=f"{group}-summary", job_type="sweep-summary", mode=mode,
                     tags=list(logger.get("tags") or []), settings=console_settings(mode))
    try:
        run.log({"sweep/summary": wandb.Table(columns=list[str | int](headers), data=data)})
    finally:
        finish_and_flush(run)


class SweepSummary(Callback):
    """``hydra.callbacks.sweep_summary`` in conf/hydra/default.yaml."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """A sweep job ended (trained or failed): the table of the jobs finished so far."""
        if OmegaConf.select(config, "hydra.mode") != RunMode.MULTIRUN:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_summaries(sweep_dir)
        if rows:
            write_table(rows, sweep_dir)
        if job_return.status == JobStatus.FAILED and rows:
            print(f"sweep job {config.hydra.job.num} failed; the table of the {len(rows)} finished job(s): "
                  f"{sweep_dir / 'sweep_summary.md'}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_summaries(sweep_dir)
        if not rows:
            return
        write_table(rows, sweep_dir)
        logger = config.get("logger")
        if logger is not None and logger.get("name") == "wandb" and logger.get("mode") != "disabled":
            log_wandb_table(rows, sweep_dir, logger)
        print(f"sweep summary of {len(rows)} job(s): {sweep_dir / 'sweep_summary.md'} (table), "
              f"{sweep_dir / 'summary.csv'} (every key)", flush=True)

"""Reading ``gpipe-train -m`` output back: each job's ``summary.json`` and composed config.

A Hydra multirun writes one folder per job (``<sweep dir>/<job number>/``) holding
``summary.json`` (``gpipe_lab.lightning.callbacks.PipelineMetrics``) and
``.hydra/config.yaml`` / ``.hydra/overrides.yaml``. ``load_runs`` finds every such
job under the given folders (a sweep dir, or a parent of several), so experiment
scripts can assemble their tables from Hydra sweeps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


class MultirunError(ValueError):
    """``--from-multirun`` folders holding no job a script reads: missing, empty, or of other experiments."""


@dataclass
class Run:
    """One finished gpipe-train job."""

    path: Path
    summary: dict[str, Any]
    config: DictConfig
    overrides: list[str]

    @property
    def experiment(self) -> str | None:
        """The ``experiment=`` chosen for the job (from its overrides), or None."""
        return next((o.split("=", 1)[1] for o in self.overrides if o.startswith("experiment=")), None)

    def get(self, key: str, default: Any = None) -> Any:
        """A dotted key of the job's composed config (``model.logit_clip``), or ``default``."""
        value = OmegaConf.select(self.config, key, default=default, throw_on_missing=False)
        return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def load_runs(dirs: Sequence[str | Path], experiments: Sequence[str] | None = None) -> list[Run]:
    """Every job (a ``summary.json`` next to ``.hydra/config.yaml``) under ``dirs``, in path order.

    With ``experiments``, only jobs of those ``experiment=`` configs are kept.

    Raises:
        MultirunError: a folder of ``dirs`` does not exist, or no finished job (of ``experiments``)
            is under ``dirs``; the message names the folders and what was looked for.
    """
    runs: list[Run] = []
    for folder in map(Path, dirs):
        if not folder.is_dir():
            raise MultirunError(f"multirun folder {folder} does not exist; give the folder gpipe-train -m printed "
                                "(logs/train/multiruns/<time>)")
        for path in sorted(folder.rglob("summary.json"), key=lambda p: [(len(s), s) for s in p.parts]):
            hydra_dir = path.parent / ".hydra"
            if not (hydra_dir / "config.yaml").exists():
                continue  # e.g. the sweep's own summary.json (a list of rows)
            overrides = OmegaConf.load(hydra_dir / "overrides.yaml") if (hydra_dir / "overrides.yaml").exists() else []
            run = Run(path.parent, json.loads(path.read_text()), OmegaConf.load(hydra_dir / "config.yaml"),
                      [str(o) for o in overrides])  # type: ignore[union-attr]
            if experiments is None or run.experiment in experiments:
                runs.append(run)
    if not runs:
        wanted = f" of experiment={'|'.join(experiments)}" if experiments else ""
        raise MultirunError(f"no finished gpipe-train job{wanted} under {', '.join(map(str, dirs))}: expected "
                         "<dir>/<job>/summary.json with <job>/.hydra/config.yaml (the output of gpipe-train -m)")
    return runs


def run_dirs_note(dirs: Sequence[str | Path], runs: Sequence[Run]) -> str:
    """Markdown naming the multirun folders, how many jobs they held, and each experiment's model."""
    models = {}
    for run in runs:
        model = {k: v for k, v in (run.get("model") or {}).items() if k != "name"}
        models.setdefault(run.experiment, f"`{run.get('model.name')}` {model}")
    return (f"Collected from {len(runs)} gpipe-train job(s) under {', '.join(f'`{d}`' for d in dirs)} "
            f"({'; '.join(f'{e}: {m}' for e, m in models.items())}; model of the first job of each).")


def throughput_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per job in the shape of ``throughput_lib.run_grid``'s (measured only, by gpipe-train).

    Raises:
        ValueError: a job whose config has no ``experiment.label`` (not a ``paper_table*`` run).
    """
    rows = []
    for run in runs:
        label = run.get("experiment.label")
        if label is None:
            raise ValueError(f"job {run.path} (experiment={run.experiment}) has no experiment.label: "
                             "not a paper_table2_* / paper_table3_* run")
        s = run.summary
        sps = s.get("samples_per_s")
        rows.append({"workload": label, "experiment": run.experiment, "K": s.get("K"), "M": s.get("M"),
                     "batch": s.get("batch_size"), "balance": s.get("balance"), "measured_s": None,
                     "simulated_s": None, "measured_sps": sps, "simulated_sps": None,
                     "measured_bubble": s.get("bubble_measured"), "bubble_theory": s.get("bubble_theory"),
                     "final_train_loss": s.get("final_train_loss"), "steps": s.get("steps"),
                     "compile": bool(run.get("pipeline.compile", False)), "job": str(run.path),
                     "threads": (s["K"] * s["threads_per_stage"]) if s.get("threads_per_stage") and s.get("K")
                     else None, "commit": s.get("commit")})
    return rows


def f2(value: float | None, tag: str = "") -> str:
    """Two decimals (and a tag), or '-'."""
    return "-" if value is None else f"{value:.2f}{tag}"


JOB_HEADER = ["job", "experiment", "K", "M", "threads", "samples/s", "bubble measured", "bubble theory", "final loss",
              "commit"]


def jobs_table(rows: Sequence[dict[str, Any]]) -> list[list[object]]:
    """One line per gpipe-train job of ``throughput_rows`` (columns ``JOB_HEADER``)."""
    return [[Path(r["job"]).name, r["experiment"], r["K"], r["M"], r.get("threads") or "-", f2(r["measured_sps"]),
             f2(r["measured_bubble"]), f2(r["bubble_theory"]), f2(r["final_train_loss"]),
             f"`{r['commit']}`" if r.get("commit") else "not recorded"] for r in rows]

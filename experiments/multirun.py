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
        FileNotFoundError: a folder of ``dirs`` does not exist.
        ValueError: no finished job (of ``experiments``) under ``dirs``; the message names
            the folders and what was looked for.
    """
    runs: list[Run] = []
    for folder in map(Path, dirs):
        if not folder.is_dir():
            raise FileNotFoundError(f"multirun folder {folder} does not exist")
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
        raise ValueError(f"no finished gpipe-train job{wanted} under {', '.join(map(str, dirs))}: expected "
                         "<dir>/<job>/summary.json with <job>/.hydra/config.yaml (the output of gpipe-train -m)")
    return runs


def run_dirs_note(dirs: Sequence[str | Path], runs: Sequence[Run]) -> str:
    """One markdown sentence naming the multirun folders and how many jobs they held."""
    return f"Collected from {len(runs)} gpipe-train job(s) under {', '.join(f'`{d}`' for d in dirs)}."

"""``SweepCheck``: a Hydra callback that validates every job of a sweep before any job runs; and
what a sweep varies (``swept_keys``), which a job's run name and the sweep's table show.

``gpipe-train -m pipeline.chunks=4,64,2`` composes each job of the basic sweeper and makes the
single run's check on it (``gpipe_lab.app.config.check_config``: the config, K against the model's
layers, the checkpoints, the accelerator); when some jobs cannot run, the sweep stops before the first
one trains, with one line per failing job (its number, overrides and the error). Registered in
``conf/hydra/default.yaml`` (``hydra.callbacks.sweep_check``). Other sweepers (whose jobs are not
known in advance) are left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_overrides(config: DictConfig) -> list[Any]:
    """The multirun ``config``'s overrides as Hydra parses them: ``hydra.sweeper.params``, then the
    command line's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    return OverridesParser.create().parse_overrides(arguments)


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The overrides of each job the basic sweeper will launch for this multirun ``config``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [job for batch in BasicSweeper.split_arguments(sweep_overrides(config), None) for job in batch]


def override_key(override: str) -> str:
    """The key an override sets: ``seed`` for ``seed=1``, ``++hydra.run.dir=x`` and ``~a.b`` give ``hydra.run.dir`` and ``a.b``."""
    return override.split("=", 1)[0].lstrip("+~")


def swept_keys(config: DictConfig) -> list[str]:
    """The keys that take several values in the multirun ``config`` (its sweep overrides, e.g.
    ``optimizer.lr`` for ``-m optimizer.lr=0.001,0.01``; ``hydra.sweeper.params`` included)."""
    return [o.key_or_group for o in sweep_overrides(config) if o.is_sweep_override()]


def job_overrides() -> list[str]:
    """The Hydra job's command-line overrides (none outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def job_sweep_values() -> dict[str, str]:
    """In a job of a multirun: its values of the keys the sweep varies (``{"optimizer.lr": "0.01"}``),
    read from the sweep's ``multirun.yaml``, which Hydra writes before the first job; empty for a
    single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return {}
    hydra_cfg = HydraConfig.get()
    saved = Path(hydra_cfg.sweep.dir) / "multirun.yaml"
    if not saved.is_file():
        return {}
    multirun = OmegaConf.load(saved)
    keys = swept_keys(multirun) if isinstance(multirun, DictConfig) else []
    values = {override_key(o): o.split("=", 1)[1] for o in hydra_cfg.overrides.task if "=" in o}
    return {k: values[k] for k in keys if k in values}


def failing_jobs(config: DictConfig, config_name: str) -> list[str]:
    """One line per job of the sweep whose composed config fails ``check_config``."""
    from hydra import compose

    from gpipe_lab.app.config import ConfigError, check_config

    failed = []
    for num, overrides in enumerate(sweep_jobs(config)):
        try:
            check_config(compose(config_name, overrides=overrides))
        except ConfigError as exc:
            failed.append(f"  job {num} ({' '.join(overrides)}): {exc}")
    return failed


class SweepCheck(Callback):
    """See the module docstring."""

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        """Raises: SystemExit listing the failing jobs (nothing has trained yet)."""
        if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER or config_name is None:
            return
        failed = failing_jobs(config, config_name)
        if failed:
            total = len(sweep_jobs(config))
            raise SystemExit(f"config error in {len(failed)} of {total} sweep jobs; no job was run. "
                             f"Fix or drop these values:\n" + "\n".join(failed))

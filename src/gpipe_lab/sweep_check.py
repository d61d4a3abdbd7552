"""``SweepCheck``: a Hydra callback that validates every job of a sweep before any job runs.

``gpipe-train -m pipeline.chunks=4,64,2`` composes each job of the basic sweeper and makes the
single run's checks on it (``gpipe_lab.preflight``: the config, K against the model's layers,
the checkpoints, the accelerator); when some jobs cannot run, the sweep stops before the first
one trains, with one line per failing job (its number, overrides and the error). Registered in
``conf/hydra/default.yaml`` (``hydra.callbacks.sweep_check``). Other sweepers (whose jobs are not
known in advance) are left alone.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The overrides of each job the basic sweeper will launch for this multirun ``config``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    overrides = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def failing_jobs(config: DictConfig, config_name: str) -> list[str]:
    """One line per job of the sweep whose composed config fails ``preflight``."""
    from hydra import compose

    from gpipe_lab.config import ConfigError
    from gpipe_lab.preflight import preflight

    failed = []
    for num, overrides in enumerate(sweep_jobs(config)):
        try:
            preflight(compose(config_name, overrides=overrides))
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

"""``ClaimRunDir``: a Hydra callback that gives every run, and every sweep, a folder of its own.

A run's folder is ``logs/<task>/runs/<time to the second>`` and a sweep's is
``logs/<task>/multiruns/<time>`` (``conf/hydra/default.yaml``), so two runs started within one second
(a shell loop with ``&``, an array job) would share one folder: the second would overwrite the first's
``.hydra`` config and their checkpoints and logs would mix. Before Hydra makes the folder, this
callback claims it with ``os.mkdir``, which only one process can win; the others take ``<time>_1``,
``<time>_2``, ... A folder named on the command line (``hydra.run.dir=...``, ``hydra.sweep.dir=...``:
torchrun's other ranks and the processes Lightning launches join rank 0's that way, and
``experiments/regenerate`` resumes its sweeps in theirs) is used as given.

Registered in ``conf/hydra/default.yaml`` (``hydra.callbacks.run_dir``), before the other callbacks.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write


def claim_dir(path: str | Path) -> Path:
    """Create the folder ``path`` (its parents too), or, when it exists, the first of ``path_1``,
    ``path_2``, ... that does not; return the folder this call created.

    Raises:
        OSError: the parent folder cannot be created or written (a read-only file system, no permission).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        candidate = path if n == 0 else path.with_name(f"{path.name}_{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("unreachable")  # itertools.count() does not end


def named_on_command_line(config: DictConfig, key: str) -> bool:
    """Whether the command line set the Hydra key ``key`` (``hydra.run.dir``), with or without ``+``/``++``."""
    return any(str(o).split("=", 1)[0].lstrip("+~") == key for o in config.hydra.overrides.hydra)


class ClaimRunDir(Callback):
    """Claims the run's (``on_run_start``) or the sweep's (``on_multirun_start``) folder before Hydra
    makes it; when the folder exists already, points Hydra at the suffixed one it claimed instead."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if named_on_command_line(config, "hydra.run.dir"):
            return
        wanted = str(config.hydra.run.dir)  # ${now:...} resolves once: Hydra's run reads the cached value
        claimed = claim_dir(wanted)
        if claimed != Path(wanted):
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.run.dir = str(claimed)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if named_on_command_line(config, "hydra.sweep.dir"):
            return
        wanted = str(config.hydra.sweep.dir)
        claimed = claim_dir(wanted)
        if claimed != Path(wanted):
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.sweep.dir = str(claimed)
                # each job's config is composed again from these overrides (Hydra's load_sweep_config)
                config.hydra.overrides.hydra.append(f'hydra.sweep.dir="{claimed}"')

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

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from gpipe_lab.app.sweep_check import override_key


def claim_dir(path: str | Path) -> Path:
    """Create the folder ``path`` (its parents too), or, when it exists, the first of ``path_1``,
    ``path_2``, ... that does not; return the folder this call created.

    Raises:
        OSError: the parent folder cannot be created or written (a read-only file system, no permission).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        candidate = path if n == 0 else path.with_name(f"{path.name}_{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1


def claim_hydra_dir(config: DictConfig, mode: str) -> Path | None:
    """Claim the folder ``hydra.<mode>.dir`` (``mode``: ``run`` or ``sweep``) names; the claimed
    folder when it is not that one (that one existed), else ``None`` (also when the command line
    named the folder: it is used as given)."""
    key = f"hydra.{mode}.dir"
    if any(override_key(str(o)) == key for o in config.hydra.overrides.hydra):
        return None
    wanted = str(config.hydra[mode].dir)  # ${now:...} resolves once: Hydra reads the cached value after
    claimed = claim_dir(wanted)
    if claimed == Path(wanted):
        return None
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra[mode].dir = str(claimed)
    return claimed


class ClaimRunDir(Callback):
    """Claims the run's (``on_run_start``) or the sweep's (``on_multirun_start``) folder before Hydra
    makes it; when the folder exists already, points Hydra at the suffixed one it claimed instead."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        claim_hydra_dir(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        claimed = claim_hydra_dir(config, "sweep")
        if claimed is not None:
            with read_write(config.hydra), open_dict(config.hydra):
                # each job's config is composed again from these overrides (Hydra's load_sweep_config)
                config.hydra.overrides.hydra.append(f'hydra.sweep.dir="{claimed}"')

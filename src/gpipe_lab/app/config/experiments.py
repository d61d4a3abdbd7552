"""The experiment configs (``conf/experiment/*.yaml``): their names, and one composed with ``train.yaml``.

The experiments read their settings from these configs, and the benchmarks' probes the
workloads the experiments define there (``workload_of`` turns a config's workload block into a
``WorkloadSpec``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gpipe_lab.app.config.schema import CONFIG_DIR
from gpipe_lab.planner.workload import WorkloadSpec


def experiment_names() -> list[str]:
    """The names of every ``conf/experiment/*.yaml``."""
    return sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def compose_experiment(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """``train.yaml`` composed with ``experiment=<name>``, ``logger=none`` and ``overrides`` (no run).

    Raises:
        ValueError: ``name`` is not a file of ``conf/experiment/`` (the message lists them).
        hydra.errors.HydraException: a bad override (Hydra's message names the key).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import gpipe_lab.app.config.schema  # noqa: F401  (registers the generated pipeline/schema node)

    names = experiment_names()
    if name not in names:
        raise ValueError(f"unknown experiment {name!r}; allowed: {', '.join(names)}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return compose("train", overrides=[f"experiment={name}", "logger=none", *overrides])


def workload_of(block: Any, label: str | None = None) -> WorkloadSpec:
    """A ``WorkloadSpec`` from a config block ``{preset, sizes, batch}`` named ``label``, or from an
    ``experiment`` block holding ``label`` and ``workload``.

    Raises:
        KeyError: a block without ``preset``, ``sizes`` or ``batch``.
    """
    if label is None:
        label, block = block.label, block.workload
    data = OmegaConf.to_container(block, resolve=True) if not isinstance(block, dict) else block
    missing = [k for k in ("preset", "sizes", "batch") if not isinstance(data, dict) or k not in data]
    if missing or not isinstance(data, dict):
        raise KeyError(f"workload {label!r}: missing {missing} (needs preset, sizes, batch)")
    return WorkloadSpec(str(label), str(data["preset"]), dict(data["sizes"]), int(data["batch"]))

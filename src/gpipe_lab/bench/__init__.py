"""What the benchmarks and the paper experiments share: their MLP and emulated workloads, step timing, tables.

``benchmarks/`` and ``experiments/`` are script packages run from the repository
root (``python -m benchmarks.run``); the definitions both need live here, once.
The names below are imported on first use, so that ``gpipe_lab.bench.script_launch``
(which a script runs before anything else) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "EmulatedLayer": "emulated", "EmulatedSpec": "emulated", "emulated_module": "emulated",
    "emulated_workload": "emulated", "mlp": "workloads", "mlp_module": "workloads", "md_table": "markdown",
    "Progress": "progress",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """Import a shared name from its module on first use.

    Raises:
        AttributeError: a name this package does not define.
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gpipe_lab.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gpipe_lab.bench.{home}"), name)
    globals()[name] = value
    return value

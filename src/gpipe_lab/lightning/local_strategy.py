"""``LocalGPipeStrategy``: the local transport, one process, a worker thread per stage (``GPipe``).

Every stage lives in this process, so Lightning's single-process behaviour holds as is:
collectives are the identity, the precision plugin's ``GradScaler`` and gradient clipping
see every stage's gradients, and a checkpoint is the module's own state dict. The placement
and collectives of such a process are ``GPipeStrategy``'s own; this class adds the engine.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
from torch import nn

from gpipe_lab.lightning.engine import PipelineEngine, build_local_engine
from gpipe_lab.lightning.strategy import GPipeStrategy
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.devices.cpu_share import default_threads
from gpipe_lab.pipeline.options import PipelineOptions


class LocalGPipeStrategy(GPipeStrategy, transport="local"):
    """``GPipeStrategy`` with ``transport="local"`` (see ``GPipeStrategy`` for the arguments)."""

    def transport_arguments(self, process_group_backend: str | None) -> dict[str, Any]:
        """No process group here.

        Raises:
            ValueError: ``process_group_backend`` is given.
        """
        if process_group_backend is not None:
            raise ValueError(f"process_group_backend={process_group_backend!r}: only the distributed transport "
                             "has a process group; set transport='distributed' or leave it out")
        return {}

    def setup_environment(self) -> None:
        """On a CPU, the caller's own thread (optimizer step, data, logging, evaluation's host work)
        gets the free cores' share of one consumer, as a stage does, unless ``OMP_NUM_THREADS`` sets
        it: torch's default of every core makes each small multi-threaded kernel of the optimizer
        wait at a barrier for a core another process holds."""
        super().setup_environment()
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(default_threads(1))

    def build_engine(self, layers: nn.Sequential, options: PipelineOptions) -> PipelineEngine:
        return build_local_engine(layers, options, self.local_devices(), self._module().init_layer)

    @property
    def engine(self) -> GPipe:
        """The engine as its own type (built in ``setup``)."""
        assert self.pipe is not None, "the engine is built in setup()"
        return cast(GPipe, self.pipe)

    @property
    def cpu_threads(self) -> int | None:
        if self.pipe is None or all(d.type != "cpu" for d in self.engine.devices):
            return None
        return self.engine.threads_per_stage

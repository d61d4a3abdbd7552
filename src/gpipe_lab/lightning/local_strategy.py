"""``LocalGPipeStrategy``: the local transport, one process, a worker thread per stage (``GPipe``).

Every stage lives in this process, so Lightning's single-process behaviour holds as is:
collectives are the identity, the precision plugin's ``GradScaler`` and gradient clipping
see every stage's gradients, and a checkpoint is the module's own state dict. The placement
and collectives of such a process are ``GPipeStrategy``'s own; this class adds the engine.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from gpipe_lab.lightning.engine import PipelineEngine, build_local_engine
from gpipe_lab.lightning.strategy import GPipeStrategy
from gpipe_lab.pipeline import GPipe
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

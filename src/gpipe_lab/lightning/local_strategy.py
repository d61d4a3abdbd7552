"""``LocalGPipeStrategy``: the local transport, one process, a worker thread per stage (``GPipe``).

Every stage lives in this process, so Lightning's single-process behaviour holds as is:
collectives are the identity, the precision plugin's ``GradScaler`` and gradient clipping
see every stage's gradients, and a checkpoint is the module's own state dict.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from gpipe_lab.lightning.engine import PipelineEngine, build_local_engine
from gpipe_lab.lightning.placement import place_outside
from gpipe_lab.lightning.strategy import GPipeStrategy
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.devices.assignment import normalize_device
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

    def local_devices(self) -> list[torch.device] | None:
        """One device per stage: ``stage_devices``, else the Trainer's GPUs, else the engine's choice.

        Raises:
            ValueError: the Trainer has fewer GPUs than stages.
        """
        if self.stage_devices is not None:
            return [normalize_device(d) for d in self.stage_devices]
        devices = self.parallel_devices or []
        if devices and all(d.type == "cuda" for d in devices):
            if len(devices) < self.num_stages:
                raise ValueError(f"{self.num_stages} pipeline stages need {self.num_stages} devices; the "
                                 f"Trainer has {len(devices)}: set trainer.devices={self.num_stages}")
            return list(devices[: self.num_stages])
        return None

    @property
    def root_device(self) -> torch.device:
        if self.pipe is not None:
            return self.engine.devices[0]
        devices = self.local_devices()
        return devices[0] if devices else torch.device("cpu")

    @property
    def output_device(self) -> torch.device:
        """Device of the last stage (where the loss and the outputs live)."""
        return self.engine.devices[-1] if self.pipe is not None else self.root_device

    def model_to_device(self) -> None:
        """Every stage on its own device, the module's other tensors on the root device.

        Moving the whole module to the root device first would need the whole
        model's memory on one GPU.
        """
        assert self.model is not None
        if self.pipe is None:
            self.model.to(self.root_device)
            return
        for part, device in zip(self.engine.partitions, self.engine.devices):
            part.to(device)
        place_outside(self.model, self.engine.module, self.root_device)

    # ------------------------------------------------------------------ collectives: one process
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

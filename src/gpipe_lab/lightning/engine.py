"""What ``GPipeStrategy`` needs from an engine, and how it builds one from ``PipelineOptions``.

The strategy holds its engine through ``PipelineEngine`` only: build it (``build_engine``),
run a training step, run a forward, read the last timeline and the per-stage memory, place
this process's stages. Both front doors of the engine (``GPipe``: a thread per stage;
``DistributedGPipe``: a process per stage) satisfy it: the builders below return them as
``PipelineEngine``, which the type checker verifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from gpipe_lab.pipeline import GPipe, Timeline
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.pipeline.partitioning.materialize import InitFn
from gpipe_lab.pipeline.stage.stage_state import LossFn
from gpipe_lab.pipeline.step.batching import Normalizer


@runtime_checkable
class PipelineEngine(Protocol):
    """The engine as the strategy uses it (``GPipe`` or ``DistributedGPipe``)."""

    last_step_skipped: bool
    skipped_steps: int

    @property
    def num_stages(self) -> int:
        """K pipeline ranks (threads or processes)."""

    @property
    def balance(self) -> list[int]:
        """Layers per chunk: K·v entries with v virtual stages."""

    @property
    def timeline(self) -> Timeline | None:
        """The last step's timeline (this rank's)."""

    @property
    def devices(self) -> list[torch.device]:
        """The devices of this process's stages."""

    @property
    def partitions(self) -> Sequence[nn.Module]:
        """This process's stage modules (on ``devices``)."""

    def train_step(self, inputs: Any, targets: Any, loss_fn: LossFn, loss_normalizer: Normalizer | None = None,
                   return_outputs: bool = False, step: int | None = None) -> Any:
        """Forward and backward of every micro-batch; returns the loss (and outputs)."""

    def __call__(self, inputs: Any) -> Any:
        """Forward only (evaluation)."""

    def memory(self) -> list[dict[str, int]]:
        """Per stage: parameter bytes and the last step's peak activation bytes."""


def build_local_engine(layers: nn.Sequential, options: PipelineOptions,
                       devices: Sequence[torch.device] | None, init_fn: InitFn | None = None) -> PipelineEngine:
    """``GPipe`` over ``layers`` with every option: a thread per stage on ``devices`` (``None``:
    ``options.devices``, else the engine's choice).

    ``init_fn(index, layer)`` initializes a layer built on ``meta`` once it is on its device.

    Raises:
        ValueError, TypeError: what the engine raises for options that cannot run on ``layers``.
    """
    if devices is not None:
        options = options.replace(devices=list(devices))
    return GPipe(layers, options=options, init_fn=init_fn)


def build_distributed_engine(layers: nn.Sequential, options: PipelineOptions, device: torch.device,
                             data_parallel_size: int, init_fn: InitFn | None = None) -> PipelineEngine:
    """``DistributedGPipe`` with every option: this rank's stage of ``layers`` on ``device``; a collective.

    ``init_fn(index, layer)`` initializes this rank's layers built on ``meta``.

    Raises:
        ValueError, TypeError: what the engine raises for options that cannot run on ``layers``.
    """
    from gpipe_lab.pipeline.distributed import DistributedGPipe

    return DistributedGPipe(layers, options=options, device=device, data_parallel_size=data_parallel_size,
                            init_fn=init_fn)

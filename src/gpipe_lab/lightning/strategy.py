"""``GPipeStrategy``: Lightning runs a ``PipelineModule`` through the GPipe engine.

This module holds the strategy's arguments, setup and collectives. How a mini-batch
runs through the pipeline (and the gradient-zeroing trap of automatic optimization)
is in ``pipeline_runner``; the distributed half (processes, process groups,
checkpoints across stages) in ``distributed_support``.

Transports: ``"local"`` (one process, a worker thread per stage, the engine's
``GPipe``) and ``"distributed"`` (one process per stage, ``DistributedGPipe``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn

from gpipe_lab.lightning.distributed_support import DistributedMixin
from gpipe_lab.lightning.engine import PipelineEngine, build_local_engine
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.pipeline_runner import PipelineRunnerMixin
from gpipe_lab.pipeline import Timeline
from gpipe_lab.pipeline.options import TRANSPORTS, PipelineOptions

__all__ = ["TRANSPORTS", "GPipeStrategy"]


class GPipeStrategy(PipelineRunnerMixin, DistributedMixin, ParallelStrategy):
    """Pipeline-parallel training of a ``PipelineModule`` (registered as ``"gpipe"``).

    Args:
        options: every pipeline setting (``PipelineOptions``: K or the balance, M, the
            re-materialization mode, the schedule, the transport, the non-finite policy, ...).
        partitions, balance, chunks, checkpoint, schedule, virtual_stages, transport,
            deferred_batch_norm, cost, seed, threads_per_stage, timeout, nonfinite: the
            ``PipelineOptions`` field of that name, over ``options`` when given (not ``None``).
            ``threads_per_stage`` sets the intra-op threads of each CPU stage: a thread of the
            local transport, or a rank's process of the distributed one.
        stage_devices: alias of ``PipelineOptions.devices``: local transport only, one device
            per stage (default: the Trainer's devices when there are K of them, else CUDA when
            enough GPUs, else CPU).
        process_group_backend: distributed transport: ``gloo``/``nccl`` (default by device).
        Other arguments: as for Lightning's ``ParallelStrategy``.

    With ``nonfinite="skip"`` a mini-batch whose loss or gradients are NaN/inf gets no
    optimizer step (nor does its accumulation window); ``train/skipped_steps`` counts them.
    In distributed runs every rank takes the same decision.

    Raises:
        OptionError: (a ``ValueError``) an option with a value that cannot run, naming it.
        TypeError: ``options`` is not a ``PipelineOptions``.
    """

    strategy_name = "gpipe"

    def __init__(self, options: PipelineOptions | None = None, *, partitions: int | None = None,
                 balance: Sequence[int] | None = None, chunks: int | None = None,
                 checkpoint: str | None = None, schedule: str | None = None,
                 virtual_stages: int | None = None, transport: str | None = None,
                 deferred_batch_norm: bool | None = None, cost: Any = None, seed: int | None = None,
                 stage_devices: Sequence[str] | None = None, threads_per_stage: int | None = None,
                 timeout: float | None = None, nonfinite: str | None = None,
                 process_group_backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if options is not None and not isinstance(options, PipelineOptions):
            raise TypeError(f"options must be a PipelineOptions, got {type(options).__name__}")
        aliases = dict(partitions=partitions, balance=list(balance) if balance is not None else None,
                       chunks=chunks, checkpoint=checkpoint, schedule=schedule, virtual_stages=virtual_stages,
                       transport=transport, deferred_batch_norm=deferred_batch_norm, cost=cost, seed=seed,
                       devices=[str(d) for d in stage_devices] if stage_devices is not None else None,
                       threads_per_stage=threads_per_stage, timeout=timeout, nonfinite=nonfinite)
        given = {k: v for k, v in aliases.items() if v is not None}
        self.options = (options or PipelineOptions()).replace(**given).check()
        self._skip_pending = False
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.pipe: PipelineEngine | None = None
        self._pending: Any = None
        self._precision_hooks: list[Any] = []
        self.last_loss: Tensor | None = None
        self.last_batch_size: tuple[int, int] = (0, 0)

    # ------------------------------------------------------------------ options, read-only
    @property
    def partitions(self) -> int | None:
        return self.options.partitions

    @property
    def balance(self) -> list[int] | None:
        return self.options.balance

    @property
    def chunks(self) -> int:
        return self.options.chunks

    @property
    def checkpoint(self) -> str:
        return self.options.checkpoint

    @property
    def schedule(self) -> str:
        return self.options.schedule

    @property
    def transport(self) -> str:
        return self.options.transport

    @property
    def nonfinite(self) -> str:
        return self.options.nonfinite

    @property
    def timeout(self) -> float:
        return self.options.timeout

    @property
    def stage_devices(self) -> list[str] | None:
        """Alias of ``options.devices``."""
        return self.options.devices

    # ------------------------------------------------------------------ properties
    @property
    def is_distributed(self) -> bool:
        return self.transport == "distributed"

    @property
    def num_stages(self) -> int:
        """K: pipeline ranks (threads or processes); each holds ``virtual_stages`` chunks."""
        return self.pipe.num_stages if self.pipe is not None else self.options.num_stages

    @property
    def root_device(self) -> torch.device:
        if self.is_distributed:
            return self._distributed_root_device()
        if self.pipe is not None:
            return self.pipe.devices[0]  # type: ignore[attr-defined]
        devices = self._local_devices()
        return devices[0] if devices else torch.device("cpu")

    @property
    def output_device(self) -> torch.device:
        """Device of the last stage (where the loss and the outputs live)."""
        if self.pipe is not None and not self.is_distributed:
            return self.pipe.devices[-1]  # type: ignore[attr-defined]
        return self.root_device

    @property
    def timeline(self) -> Timeline | None:
        """The timeline of the last pipeline call (this rank's events in distributed)."""
        return None if self.pipe is None else self.pipe.timeline

    def memory(self) -> list[dict[str, int]]:
        """Per stage: parameter bytes and the last step's peak activation bytes (this rank's)."""
        return [] if self.pipe is None else self.pipe.memory()

    def step_report(self) -> tuple[Timeline | None, list[dict[str, int]]]:
        """Timeline and per-stage memory of the whole pipeline; a collective in distributed."""
        if not self.is_distributed or self.pipe is None or self.pipe.timeline is None:
            return self.timeline, self.memory()
        return self.pipe.gather_timeline(), self._gather_memory()  # type: ignore[attr-defined]

    def _local_devices(self) -> list[torch.device] | None:
        if self.stage_devices is not None:
            return [torch.device(d) for d in self.stage_devices]
        devices = self.parallel_devices or []
        if devices and all(d.type == "cuda" for d in devices):
            if len(devices) < self.num_stages:
                raise ValueError(f"{self.num_stages} pipeline stages need {self.num_stages} devices; the "
                                 f"Trainer has {len(devices)}: set trainer.devices={self.num_stages}")
            return list(devices[: self.num_stages])
        return None

    # ------------------------------------------------------------------ setup
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self._module()
        self.model = self.precision_plugin.convert_module(self.model)
        layers = module.configure_layers()
        self._enter_precision_in_stages(layers)
        if self.pipe is None:
            if not self.is_distributed:
                self.model_to_device()
            self.pipe = self._build_pipeline(layers)
        elif not self.is_distributed:  # a later fit/validate: teardown moved the module to CPU
            for part, device in zip(self.pipe.partitions, self.pipe.devices):  # type: ignore[attr-defined]
                part.to(device)
        module.attach_pipeline(self)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.is_distributed:
            self._install_global_clipping()

    def _build_pipeline(self, layers: nn.Sequential) -> PipelineEngine:
        if self.is_distributed:
            return self._build_distributed_pipeline(layers)
        return build_local_engine(layers, self.options, self._local_devices())

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self.is_distributed:
            return self._distributed_reduce(tensor, group, reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if self.is_distributed:
            self._distributed_barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._distributed_broadcast(obj, src) if self.is_distributed else obj

    def teardown(self) -> None:
        module = self.lightning_module
        if isinstance(module, PipelineModule):
            module.attach_pipeline(None)
        for handle in self._precision_hooks:
            handle.remove()
        self._precision_hooks = []
        if self.is_distributed:  # other stages' layers live on meta: no module.cpu()
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()


StrategyRegistry.register("gpipe", GPipeStrategy, description="GPipe pipeline parallelism",
                          override=True)

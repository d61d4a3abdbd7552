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
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.pipeline_runner import PipelineRunnerMixin
from gpipe_lab.pipeline import CHECKPOINT_MODES, NONFINITE_POLICIES, SCHEDULES, GPipe, Timeline

TRANSPORTS = ("local", "distributed")


class GPipeStrategy(PipelineRunnerMixin, DistributedMixin, ParallelStrategy):
    """Pipeline-parallel training of a ``PipelineModule`` (registered as ``"gpipe"``).

    Args:
        partitions: K, balanced automatically by ``cost``; or
        balance: layers per partition, e.g. ``[3, 6]``.
        chunks: M micro-batches per mini-batch.
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` or ``"never"``.
        schedule: ``"gpipe"``, ``"1f1b"`` or any schedule the engine registered.
        transport: ``"local"`` (threads) or ``"distributed"`` (one process per stage).
        deferred_batch_norm: per-mini-batch BatchNorm running statistics.
        cost: per-layer cost for the automatic balance (``"params"`` or a list).
        seed: base seed of the per-(step, stage, micro-batch) generators.
        stage_devices: local transport only: one device per stage (default: the
            Trainer's devices when there are K of them, else CUDA when enough GPUs, else CPU).
        threads_per_stage: intra-op threads of each CPU stage (a thread, or a rank's process).
        timeout: seconds a stage waits for a neighbour before the step fails.
        nonfinite: a NaN/inf loss or gradient ``"raise"`` the engine's ``NonFiniteError``
            (naming the step and the stage; training stops), ``"skip"`` the optimizer
            step of that mini-batch (or accumulation window; logs ``train/skipped_steps``),
            or ``"ignore"``. In distributed runs every rank takes the same decision.
        compile: ``torch.compile`` each stage (``True``, or a dict of its keywords).
        Other arguments: as for Lightning's ``ParallelStrategy``.

    Raises:
        ValueError: unknown transport / checkpoint / schedule / nonfinite, or neither/both of
            partitions and balance inconsistent; messages name the key.
    """

    strategy_name = "gpipe"

    def __init__(self, partitions: int | None = None, balance: Sequence[int] | None = None,
                 chunks: int = 1, checkpoint: str = "except_last", schedule: str = "gpipe",
                 transport: str = "local", deferred_batch_norm: bool = False, cost: Any = None,
                 seed: int | None = None, stage_devices: Sequence[str] | None = None,
                 threads_per_stage: int | None = None, timeout: float = 300.0,
                 process_group_backend: str | None = None, nonfinite: str = "raise",
                 compile: bool | dict = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {transport!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {list(CHECKPOINT_MODES)}, got {checkpoint!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {list(NONFINITE_POLICIES)}, got {nonfinite!r}")
        if partitions is None and balance is None:
            partitions = 1
        self.partitions = partitions
        self.balance = list(balance) if balance is not None else None
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.transport = transport
        self.deferred_batch_norm = deferred_batch_norm
        self.cost = cost
        self.seed = seed
        self.stage_devices = stage_devices
        self.threads_per_stage = threads_per_stage
        self.timeout = timeout
        self.nonfinite = nonfinite
        self.compile = compile
        self._skip_pending = False
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.pipe: Any = None
        self._pending: Any = None
        self.last_loss: Tensor | None = None
        self.last_batch_size: tuple[int, int] = (0, 0)

    # ------------------------------------------------------------------ properties
    @property
    def is_distributed(self) -> bool:
        return self.transport == "distributed"

    @property
    def num_stages(self) -> int:
        if self.pipe is not None:
            return len(self.pipe.balance)
        return len(self.balance) if self.balance is not None else int(self.partitions or 1)

    @property
    def root_device(self) -> torch.device:
        if self.is_distributed:
            return self._distributed_root_device()
        if self.pipe is not None:
            return self.pipe.devices[0]
        devices = self._local_devices()
        return devices[0] if devices else torch.device("cpu")

    @property
    def output_device(self) -> torch.device:
        """Device of the last stage (where the loss and the outputs live)."""
        if self.pipe is not None and not self.is_distributed:
            return self.pipe.devices[-1]
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
        return self.pipe.gather_timeline(), self._gather_memory()

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
        if self.pipe is None:
            layers = module.configure_layers()
            if not self.is_distributed:
                self.model_to_device()
            self.pipe = self._build_pipeline(layers)
            self._wrap_stages()
        elif not self.is_distributed:  # a later fit/validate: teardown moved the module to CPU
            for part, device in zip(self.pipe.partitions, self.pipe.devices):
                part.to(device)
        object.__setattr__(module, "pipeline_forward", self.pipeline_forward)
        object.__setattr__(module, "pipeline_runner", self.run_manual)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.is_distributed:
            self._install_global_clipping()

    def _build_pipeline(self, layers: nn.Sequential) -> Any:
        if self.is_distributed:
            return self._build_distributed_pipeline(layers)
        return GPipe(layers, balance=self.balance, partitions=None if self.balance else self.partitions,
                     devices=self._local_devices(), chunks=self.chunks, checkpoint=self.checkpoint,
                     schedule=self.schedule, deferred_batch_norm=self.deferred_batch_norm,
                     cost=self.cost, seed=self.seed, threads_per_stage=self.threads_per_stage,
                     timeout=self.timeout, nonfinite=self.nonfinite, compile=self.compile)

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
            object.__setattr__(module, "pipeline_forward", None)
            object.__setattr__(module, "pipeline_runner", None)
        if self.is_distributed:  # other stages' layers live on meta: no module.cpu()
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()


StrategyRegistry.register("gpipe", GPipeStrategy, description="GPipe pipeline parallelism",
                          override=True)

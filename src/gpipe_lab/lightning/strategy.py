"""``GPipeStrategy``: Lightning runs a ``PipelineModule`` through the GPipe engine.

The gradient-zeroing trap: with automatic optimization Lightning calls
``training_step``, THEN zeroes the gradients, THEN ``backward``. A schedule run in
``training_step`` would lose its gradients, so::

    training_step(batch)  -> stash the batch, return a placeholder that requires grad
    zero_grad()           -> (Lightning)
    backward(placeholder) -> run the whole schedule (forward + backward of every
                             micro-batch), log the REAL loss through the module
    optimizer.step()      -> one step per mini-batch (or per accumulation window)

With manual optimization the module calls ``self.pipeline_loss(batch)``, which runs
the schedule at once and returns the real loss; ``manual_backward`` of it is a no-op.

Transports: ``"local"`` (one process, a worker thread per stage, the engine's
``GPipe``) and ``"distributed"`` (one process per stage, ``DistributedGPipe``): see
``distributed_support``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn

from gpipe_lab.lightning.distributed_support import DistributedMixin
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.pipeline import CHECKPOINT_MODES, SCHEDULES, GPipe, Timeline

TRANSPORTS = ("local", "distributed")


class _ContextPartition(nn.Module):
    """Runs a partition inside a fresh context per call (autocast is thread-local)."""

    def __init__(self, inner: nn.Module, context: Callable[[], Any]) -> None:
        super().__init__()
        self.inner = inner
        self._context = context

    def forward(self, *args: Any) -> Any:
        with self._context():
            return self.inner(*args)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


class GPipeStrategy(DistributedMixin, ParallelStrategy):
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
        threads_per_stage: intra-op threads of each CPU stage (local transport).
        timeout: seconds a stage waits for a neighbour before the step fails.
        Other arguments: as for Lightning's ``ParallelStrategy``.

    Raises:
        ValueError: unknown transport / checkpoint / schedule, or neither/both of
            partitions and balance inconsistent; messages name the key.
    """

    strategy_name = "gpipe"

    def __init__(self, partitions: int | None = None, balance: Sequence[int] | None = None,
                 chunks: int = 1, checkpoint: str = "except_last", schedule: str = "gpipe",
                 transport: str = "local", deferred_batch_norm: bool = False, cost: Any = None,
                 seed: int | None = None, stage_devices: Sequence[str] | None = None,
                 threads_per_stage: int | None = None, timeout: float = 300.0,
                 process_group_backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {transport!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {list(CHECKPOINT_MODES)}, got {checkpoint!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
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

    def _module(self) -> PipelineModule:
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise TypeError(f"GPipeStrategy needs a gpipe_lab.lightning.PipelineModule, got "
                            f"{type(module).__name__}")
        return module

    def _stage_context(self) -> Callable[[], Any]:
        return self.precision_plugin.forward_context

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
                     timeout=self.timeout)

    def _wrap_stages(self) -> None:
        """Enter the precision plugin's forward context inside every stage's own thread."""
        context = self._stage_context()
        if isinstance(context(), nullcontext):
            return
        runtimes = getattr(self.pipe, "stages", None) or list(getattr(self.pipe, "runtimes", {}).values())
        for stage in runtimes:
            if not isinstance(stage.module, _ContextPartition):
                stage.module = _ContextPartition(stage.module, context)

    # ------------------------------------------------------------------ training
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if not module.automatic_optimization:
            return super().training_step(*args, **kwargs)
        self._pending = args[0] if args else kwargs["batch"]
        return torch.zeros((), device=self.root_device, requires_grad=True)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if getattr(closure_loss, "_gpipe_done", False):
            return closure_loss  # manual optimization: pipeline_loss already ran the schedule
        if self._pending is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        batch, self._pending = self._pending, None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        self.run_pipeline(batch, 1.0 / accumulate)
        return closure_loss

    def run_manual(self, batch: Any) -> Tensor:
        """``PipelineModule.pipeline_loss`` under this strategy: the schedule, then the loss."""
        loss = self.run_pipeline(batch, 1.0).clone()
        loss._gpipe_done = True  # type: ignore[attr-defined]
        return loss

    def run_pipeline(self, batch: Any, scale: float) -> Tensor:
        """Forward and backward of every micro-batch of ``batch``; logs and returns the real loss.

        Gradients accumulate into the parameters, multiplied by ``scale`` (1 / the number
        of accumulated mini-batches).
        """
        module = self._module()
        inputs, targets = module.split_batch(batch)
        targets = _to_device(targets, self.output_device)
        scaler = getattr(self.precision_plugin, "scaler", None)

        def loss_fn(outputs: Any, target: Any) -> Tensor:
            loss = module.loss_fn(outputs, target) * scale
            return scaler.scale(loss) if scaler is not None else loss

        trainer = module._trainer
        if trainer is not None and hasattr(self.pipe, "step_count"):
            self.pipe.step_count = max(0, trainer.fit_loop.total_batch_idx)
        loss, outputs = self.pipe.train_step(inputs, targets, loss_fn, module.loss_normalizer,
                                             return_outputs=True)
        loss = loss.detach().float()
        if scaler is not None:
            loss = loss / scaler.get_scale()
        real = (loss / scale).to(self.root_device)
        self.last_loss = real
        self.last_batch_size = module.count_samples(inputs, targets)
        previous = module._current_fx_name
        module._current_fx_name = "training_step"
        try:
            module.log_train(real, outputs, targets)
        finally:
            module._current_fx_name = previous
        return real

    def pipeline_forward(self, inputs: Any) -> Any:
        """Forward only through the pipeline (validation, test, decoding).

        Lightning evaluates under ``torch.inference_mode``, which is thread-local: the
        stage threads would try to record autograd on inference tensors, so the inputs
        are cloned into normal tensors first.
        """
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                inputs = _clone(inputs)
                return self.pipeline_forward(inputs)
        outputs = self.pipe(inputs)
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        return _to_device(outputs, first.device)

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

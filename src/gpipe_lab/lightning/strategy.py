"""``GPipeStrategy``: Lightning runs a ``PipelineModule`` through the GPipe engine.

``GPipeStrategy(options=...)`` builds the strategy of ``options.transport``:

- ``"local"``: ``LocalGPipeStrategy`` (``local_strategy``), one process, a worker thread per
  stage, the engine's ``GPipe``;
- ``"distributed"``: ``DistributedGPipeStrategy`` (``distributed_strategy``), one process per
  stage and data-parallel replica, built on Lightning's ``DDPStrategy`` (launching, process
  groups, reduce, barrier), the engine's ``DistributedGPipe``.

This class holds what both share: the options, setup and teardown around the engine, the
meta-device init context, how a mini-batch runs through the pipeline (below), and the
placement and collectives of a process that holds every stage (the local transport's; the
distributed strategy takes ``DDPStrategy``'s instead). A transport adds how its engine is built.

How a mini-batch runs through the pipeline (both transports).

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

Non-finite policy ``"skip"``: the engine drops the gradients of a mini-batch whose loss
or gradients are NaN/inf and says so (``pipe.last_step_skipped``, agreed by all ranks in
distributed runs); ``optimizer_step`` then runs the closure but not the step, for that
mini-batch's accumulation window, and ``train/skipped_steps`` counts such mini-batches.
Lightning still counts the step in ``global_step`` (as it does for an AMP-skipped step).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, ClassVar, TypeVar

import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn

from gpipe_lab.lightning.engine import PipelineEngine
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.placement import place_outside
from gpipe_lab.lightning.scaling import active_scaler, engine_nonfinite, unscale_loss
from gpipe_lab.pipeline import Timeline
from gpipe_lab.pipeline.devices.assignment import normalize_device
from gpipe_lab.pipeline.options import TRANSPORTS, OptionViews, PipelineOptions, forwarded, merged_options
from gpipe_lab.pipeline.partitioning.materialize import is_meta

OPTION_NAMES = frozenset(f.name for f in fields(PipelineOptions))

__all__ = ["TRANSPORTS", "GPipeStrategy"]

T = TypeVar("T")


def _strategy_options(options: PipelineOptions | None, stage_devices: Sequence[Any] | None,
                      overrides: dict[str, Any]) -> PipelineOptions:
    """``merged_options`` with the ``stage_devices`` alias of ``devices``, checked.

    Raises:
        OptionError: ``options`` is not a ``PipelineOptions``, an unknown option name, or a value
            that cannot run, naming it.
    """
    changes = dict(overrides) if stage_devices is None else {**overrides, "devices": list(stage_devices)}
    return merged_options(options, changes).check()


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


class GPipeStrategy(OptionViews, ParallelStrategy):
    """Pipeline-parallel training of a ``PipelineModule`` (registered as ``"gpipe"``).

    ``GPipeStrategy(...)`` returns a ``LocalGPipeStrategy`` or a ``DistributedGPipeStrategy``
    according to ``options.transport``; both are ``GPipeStrategy``s.

    Args:
        options: every pipeline setting (``PipelineOptions``: K or the balance, M, the
            re-materialization mode, the schedule, the transport, the non-finite policy, ...).
        stage_devices: alias of ``PipelineOptions.devices``: local transport only, one device
            per stage (default: the Trainer's devices when there are K of them, else CUDA when
            enough GPUs, else CPU).
        process_group_backend: distributed transport: ``gloo``/``nccl`` (default by device).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for Lightning's strategies (the Trainer fills them in).
        **option_overrides: ``PipelineOptions`` fields over ``options``
            (``GPipeStrategy(partitions=2, chunks=4)``), applied by ``options.replace``.

    With ``nonfinite="skip"`` a mini-batch whose loss or gradients are NaN/inf gets no
    optimizer step (nor does its accumulation window); ``train/skipped_steps`` counts them.
    In distributed runs every rank takes the same decision.

    Modules created in the LightningModule's ``configure_model`` hook (or under
    ``trainer.init_module()``) are built on the ``meta`` device: the engine then allocates
    each stage's layers on that stage's own device (this rank's only, in the distributed
    transport) and initializes them with ``PipelineModule.init_layer``, so no device ever
    holds the whole model. ``trainer.init_module(empty_init=False)`` builds on the host.

    Raises:
        OptionError: (a ``ValueError``) ``options`` is not a ``PipelineOptions``, an unknown option
            name or a value that cannot run, naming it.
        ValueError: ``process_group_backend`` with the local transport.
    """

    strategy_name = "gpipe"
    #: transport name -> the strategy type that runs it (filled by the subclasses).
    by_transport: ClassVar[dict[str, type[GPipeStrategy]]] = {}

    def __init_subclass__(cls, transport: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if transport is not None:
            GPipeStrategy.by_transport[transport] = cls

    def __new__(cls, options: PipelineOptions | None = None, *, stage_devices: Sequence[Any] | None = None,
                **kwargs: Any) -> GPipeStrategy:
        if cls is GPipeStrategy:  # the type of the transport; unpickling names the type itself
            overrides = {k: v for k, v in kwargs.items() if k in OPTION_NAMES}
            cls = GPipeStrategy.by_transport[_strategy_options(options, stage_devices, overrides).transport]
        return super().__new__(cls)

    def __init__(self, options: PipelineOptions | None = None, *, stage_devices: Sequence[Any] | None = None,
                 process_group_backend: str | None = None, accelerator: Any = None, parallel_devices: Any = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 **option_overrides: Any) -> None:
        self.options = _strategy_options(options, stage_devices, option_overrides)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, **self.transport_arguments(process_group_backend))
        self.pipe: PipelineEngine | None = None
        self._pending: Any = None  # the batch training_step stashed for backward
        self._skip_pending = False
        self._scheduled_loss: Tensor | None = None
        self.last_loss: Tensor | None = None
        self.last_batch_size: tuple[int, int | Tensor] = (0, 0)

    def transport_arguments(self, process_group_backend: str | None) -> dict[str, Any]:
        """Keyword arguments of the Lightning base strategy that depend on the transport."""
        raise NotImplementedError

    def build_engine(self, layers: nn.Sequential, options: PipelineOptions) -> PipelineEngine:
        """The engine over ``layers`` for this transport."""
        raise NotImplementedError

    def module_stays_in_place(self) -> bool:
        """Whether teardown leaves the module where it is: when some layers are still on ``meta``."""
        module = self.lightning_module
        return isinstance(module, nn.Module) and is_meta(module)

    def prepare_precision(self) -> None:
        """Adapt the precision plugin to the transport before it is used (default: as given)."""

    # ------------------------------------------------------------------ options, read-only
    # (chunks, checkpoint, schedule, virtual_stages, nonfinite, timeout: from OptionViews)
    partitions = forwarded("options.partitions", "K as configured (None: len(balance), else 1).")
    balance = forwarded("options.balance", "Layers per stage as configured (None: chosen by cost).")
    transport = forwarded("options.transport", "'local' (threads) or 'distributed' (processes).")
    stage_devices = forwarded("options.devices", "Alias of ``options.devices``.")

    # ------------------------------------------------------------------ reports
    @property
    def num_stages(self) -> int:
        """K: pipeline ranks (threads or processes); each holds ``virtual_stages`` chunks."""
        return self.pipe.num_stages if self.pipe is not None else self.options.num_stages

    @property
    def data_parallel_size(self) -> int:
        """D: replicas of the whole pipeline."""
        return 1

    @property
    def cpu_threads(self) -> int | None:
        """The intra-op threads each CPU stage of this process runs with (None: no CPU stage,
        or not set up yet); a resumed run reuses it (``gpipe_lab.lightning.resume``)."""
        return None

    @property
    def timeline(self) -> Timeline | None:
        """The timeline of the last pipeline call (this rank's events in distributed)."""
        return None if self.pipe is None else self.pipe.timeline

    def memory(self) -> list[dict[str, int]]:
        """Per stage: parameter bytes and the last step's peak activation bytes (this rank's)."""
        return [] if self.pipe is None else self.pipe.memory()

    def step_report(self) -> tuple[Timeline | None, list[dict[str, int]]]:
        """Timeline and per-stage memory of the whole pipeline; a collective in distributed. GPU
        stages' actions are timed by CUDA events (``Timeline.on_device``: one wait for the device):
        their host times are launch times, ahead of the device."""
        return (None if self.timeline is None else self.timeline.on_device()), self.memory()

    # ------------------------------------------------------------------ a process holding every stage
    # (the local transport; DistributedGPipeStrategy takes DDPStrategy's devices and collectives)
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
        """Device of the first stage."""
        if self.pipe is not None:
            return self.pipe.devices[0]
        devices = self.local_devices()
        return devices[0] if devices else torch.device("cpu")

    @property
    def output_device(self) -> torch.device:
        """Device of the last stage (where the loss and the outputs live)."""
        return self.pipe.devices[-1] if self.pipe is not None else self.root_device

    def model_to_device(self) -> None:
        """Every stage on its own device, the module's other tensors on the root device.

        Moving the whole module to the root device first would need the whole
        model's memory on one GPU.
        """
        assert self.model is not None
        if self.pipe is None:
            self.model.to(self.root_device)
            return
        for part, device in zip(self.pipe.partitions, self.pipe.devices):
            part.to(device)
        place_outside(self.model, self._module().configure_layers(), self.root_device)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """The identity: one process."""
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to wait for: one process."""

    def broadcast(self, obj: T, src: int = 0) -> T:
        """The identity: one process."""
        return obj

    # ------------------------------------------------------------------ setup
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Tensors created here land on ``meta`` (``empty_init=False``: on the root device).

        Lightning enters it around ``configure_model`` and ``trainer.init_module()``; the
        engine materializes each stage on its own device in ``setup``.
        """
        if empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load weights after the pipeline exists (its stages own the real parameters)."""
        return True

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.prepare_precision()
        module = self._module()
        assert self.model is not None  # connected by the Trainer before setup
        self.model = self.precision_plugin.convert_module(self.model)
        layers = module.configure_layers()
        if self.pipe is None:  # the engine puts (or allocates) each stage on its own device
            # under a GradScaler the scaler decides what an overflow does, not the engine's policy
            nonfinite = engine_nonfinite(self.options.nonfinite, self.precision_plugin)
            self.pipe = self.build_engine(layers, self.options.replace(nonfinite=nonfinite))
        self.model_to_device()  # also a later fit/validate: teardown moved the module to CPU
        module.attach_pipeline(self)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def teardown(self) -> None:
        module = self.lightning_module
        if isinstance(module, PipelineModule):
            module.attach_pipeline(None)
        if not self.module_stays_in_place():
            super().teardown()  # Lightning's: moves the module and the optimizer state to the CPU
            return
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ running the pipeline
    def _module(self) -> PipelineModule:
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise TypeError(f"GPipeStrategy needs a gpipe_lab.lightning.PipelineModule, got "
                            f"{type(module).__name__}")
        return module

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if not module.automatic_optimization:
            return super().training_step(*args, **kwargs)
        self._pending = args[0] if args else kwargs["batch"]
        return torch.zeros((), device=self.root_device, requires_grad=True)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if closure_loss is self._scheduled_loss:  # manual optimization: pipeline_loss ran the schedule
            self._scheduled_loss = None
            return closure_loss
        if self._pending is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        batch, self._pending = self._pending, None
        accumulate = self._module().trainer.accumulate_grad_batches
        self.run_pipeline(batch, 1.0 / accumulate)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """With ``nonfinite="skip"``: no step when the engine skipped a mini-batch of the window."""
        if self.nonfinite != "skip":
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()  # training_step + backward: runs the schedule (automatic optimization)
        skip, self._skip_pending = self._skip_pending, False
        if skip:
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def run_manual(self, batch: Any) -> Tensor:
        """``PipelineModule.pipeline_loss`` under this strategy: the schedule, then the loss."""
        loss = self.run_pipeline(batch, 1.0).clone()
        self._scheduled_loss = loss  # its manual_backward is a no-op: its gradients are in place
        return loss

    def run_pipeline(self, batch: Any, scale: float) -> Tensor:
        """Forward and backward of every micro-batch of ``batch``; logs and returns the real loss.

        Gradients accumulate into the parameters, multiplied by ``scale`` (1 / the number
        of accumulated mini-batches).
        """
        module = self._module()
        inputs, targets = module.split_batch(batch)
        targets = _to_device(targets, self.output_device)
        scaler = active_scaler(self.precision_plugin)

        def loss_fn(outputs: Any, target: Any) -> Tensor:
            loss = module.loss_fn(outputs, target) * scale
            return scaler.scale(loss) if scaler is not None else loss

        pipe = self._engine()
        # The batch index numbers the step's random generators, so a resumed run draws the
        # dropout masks the uninterrupted run drew.
        step = max(0, module.trainer.fit_loop.total_batch_idx)
        # the whole batch's outputs are gathered only for a log_train that can read them
        # (a Transformer's logits: megabytes copied per step for nothing otherwise)
        wants_outputs = type(module).log_train is not PipelineModule.log_train
        # entered once: the engine carries it into every stage thread and each replay
        with self.precision_plugin.forward_context():
            result = pipe.train_step(inputs, targets, loss_fn, module.loss_normalizer,
                                     return_outputs=wants_outputs, step=step)
        loss, outputs = result if wants_outputs else (result, None)
        loss = loss.detach().float()
        if scaler is not None:
            loss = unscale_loss(loss, scaler)
        real = (loss / scale).to(self.root_device)
        self.last_loss = real
        self.last_batch_size = module.count_samples(inputs, targets)
        if pipe.last_step_skipped:
            self._skip_pending = True
        # Lightning allows self.log in the strategy's backward hook (same options as training_step).
        self.log_train(module, real, outputs, targets)
        if self.nonfinite == "skip":
            module.log("train/skipped_steps", float(pipe.skipped_steps))
        return real

    def log_train(self, module: PipelineModule, loss: Tensor, outputs: Any, targets: Any) -> None:
        """``module.log_train`` of one mini-batch (the distributed transport shares the last stage's)."""
        module.log_train(loss, outputs, targets)

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None:
        """Clip the gradients of ``optimizer`` by the norm over every stage (``PipelineModule``'s
        ``configure_gradient_clipping``); here, every stage's gradients are in this process."""
        self.precision_plugin.clip_gradients(optimizer, max_norm, GradClipAlgorithmType.NORM)

    def _engine(self) -> PipelineEngine:
        if self.pipe is None:
            raise RuntimeError("GPipeStrategy has no pipeline yet: it is built in setup() by the Trainer")
        return self.pipe

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
        with self.precision_plugin.forward_context():
            outputs = self._engine()(inputs)
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        return _to_device(outputs, first.device)


StrategyRegistry.register("gpipe", GPipeStrategy, description="GPipe pipeline parallelism",
                          override=True)

"""``GPipeStrategy``: Lightning runs a ``PipelineModule`` through the GPipe engine.

This module holds the strategy's arguments, setup and collectives. How a mini-batch
runs through the pipeline (and the gradient-zeroing trap of automatic optimization)
is in ``pipeline_runner``; the distributed half (processes, process groups,
checkpoints across stages) in ``distributed_support``.

Transports: ``"local"`` (one process, a worker thread per stage, the engine's
``GPipe``) and ``"distributed"`` (one process per stage, ``DistributedGPipe``).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn

from gpipe_lab.lightning.distributed_support import DistributedMixin
from gpipe_lab.lightning.engine import PipelineEngine, build_local_engine
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.pipeline_runner import PipelineRunnerMixin
from gpipe_lab.lightning.scaling import active_scaler, agree_on_overflow, engine_nonfinite
from gpipe_lab.pipeline import Timeline
from gpipe_lab.pipeline.devices import normalize_device
from gpipe_lab.pipeline.materialize import is_meta, reset_module
from gpipe_lab.pipeline.options import TRANSPORTS, OptionViews, PipelineOptions

__all__ = ["TRANSPORTS", "GPipeStrategy"]


class GPipeStrategy(OptionViews, PipelineRunnerMixin, DistributedMixin, ParallelStrategy):
    """Pipeline-parallel training of a ``PipelineModule`` (registered as ``"gpipe"``).

    Args:
        options: every pipeline setting (``PipelineOptions``: K or the balance, M, the
            re-materialization mode, the schedule, the transport, the non-finite policy, ...).
        partitions, balance, chunks, checkpoint, schedule, virtual_stages, transport,
            deferred_batch_norm, cost, seed, threads_per_stage, timeout, nonfinite, compile: the
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

    Modules created in the LightningModule's ``configure_model`` hook (or under
    ``trainer.init_module()``) are built on the ``meta`` device: the engine then allocates
    each stage's layers on that stage's own device (this rank's only, in the distributed
    transport) and initializes them with ``PipelineModule.init_layer``, so no device ever
    holds the whole model. ``trainer.init_module(empty_init=False)`` builds on the host.

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
                 compile: bool | dict | None = None, process_group_backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if options is not None and not isinstance(options, PipelineOptions):
            raise TypeError(f"options must be a PipelineOptions, got {type(options).__name__}")
        aliases = dict(partitions=partitions, balance=list(balance) if balance is not None else None,
                       chunks=chunks, checkpoint=checkpoint, schedule=schedule, virtual_stages=virtual_stages,
                       transport=transport, deferred_batch_norm=deferred_batch_norm, cost=cost, seed=seed,
                       devices=[str(d) for d in stage_devices] if stage_devices is not None else None,
                       threads_per_stage=threads_per_stage, timeout=timeout, nonfinite=nonfinite,
                       compile=compile)
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
    # (chunks, checkpoint, schedule, virtual_stages, nonfinite, timeout: from OptionViews)
    @property
    def partitions(self) -> int | None:
        return self.options.partitions

    @property
    def balance(self) -> list[int] | None:
        return self.options.balance

    @property
    def transport(self) -> str:
        return self.options.transport

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
            return [normalize_device(d) for d in self.stage_devices]
        devices = self.parallel_devices or []
        if devices and all(d.type == "cuda" for d in devices):
            if len(devices) < self.num_stages:
                raise ValueError(f"{self.num_stages} pipeline stages need {self.num_stages} devices; the "
                                 f"Trainer has {len(devices)}: set trainer.devices={self.num_stages}")
            return list(devices[: self.num_stages])
        return None

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

    def model_to_device(self) -> None:
        """Every stage on its own device, the module's other tensors on the root device.

        Moving the whole module to the root device first would need the whole
        model's memory on one GPU.
        """
        assert self.model is not None
        if self.pipe is None:
            self.model.to(self.root_device)
            return
        if self.is_distributed:  # the engine placed this rank's layers; the others are meta
            place_outside(self.model, self._module().configure_layers(), self.root_device)
            return
        for part, device in zip(self.pipe.partitions, self.pipe.devices):
            part.to(device)
        place_outside(self.model, self.pipe.module, self.root_device)

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self._module()
        self.model = self.precision_plugin.convert_module(self.model)
        layers = module.configure_layers()
        self._enter_precision_in_stages(layers)
        if self.pipe is None:  # the engine puts (or allocates) each stage on its own device
            self.pipe = self._build_pipeline(layers)
        self.model_to_device()  # also a later fit/validate: teardown moved the module to CPU
        module.attach_pipeline(self)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.is_distributed:
            self._install_global_clipping()
            if active_scaler(self.precision_plugin) is not None:
                agree_on_overflow(self.precision_plugin.scaler)

    def _build_pipeline(self, layers: nn.Sequential) -> PipelineEngine:
        if self.is_distributed:
            return self._build_distributed_pipeline(layers)
        # under a GradScaler the scaler decides what an overflow does, not the engine's policy
        options = self.options.replace(nonfinite=engine_nonfinite(self.options.nonfinite, self.precision_plugin))
        return build_local_engine(layers, options, self._local_devices(), self._module().init_layer)

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
        if self.is_distributed or (isinstance(module, nn.Module) and is_meta(module)):  # layers left on meta (other stages'): no module.cpu()
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()


def place_outside(root: nn.Module, inner: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers of ``root`` that ``inner`` does not hold to ``device``.

    ``inner``'s tensors stay where they are; parameters keep their identity. A module of
    ``root`` built on ``meta`` is allocated on ``device`` and reset (``reset_parameters``).

    Raises:
        ValueError: a module outside ``inner`` holds meta tensors and has no
            ``reset_parameters`` / ``reset_running_stats`` to initialize them.
    """
    inside = {id(t) for t in (*inner.parameters(), *inner.buffers())}
    for name, m in root.named_modules():
        own = [t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if id(t) not in inside]
        if any(t.is_meta for t in own):
            with torch.no_grad():
                m.to_empty(device=device, recurse=False)
                if not reset_module(m):
                    raise ValueError(f"module {name or type(root).__name__!r} ({type(m).__name__}) was built on "
                                     "the meta device outside the pipelined layers and has no reset_parameters() "
                                     "to initialize it: build it in __init__ (on the host), not in configure_model")
    for m in root.modules():
        for p in m.parameters(recurse=False):
            if id(p) not in inside and p.device != device:
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(device), p.requires_grad))
        for name, b in list(m.named_buffers(recurse=False)):
            if id(b) not in inside and b.device != device:
                setattr(m, name, b.to(device))


StrategyRegistry.register("gpipe", GPipeStrategy, description="GPipe pipeline parallelism",
                          override=True)

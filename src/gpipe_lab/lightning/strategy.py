"""``GPipeStrategy``: Lightning runs a ``PipelineModule`` through the GPipe engine.

``GPipeStrategy(options=...)`` builds the strategy of ``options.transport``:

- ``"local"``: ``LocalGPipeStrategy`` (``local_strategy``), one process, a worker thread per
  stage, the engine's ``GPipe``;
- ``"distributed"``: ``DistributedGPipeStrategy`` (``distributed_strategy``), one process per
  stage and data-parallel replica, built on Lightning's ``DDPStrategy`` (launching, process
  groups, reduce, barrier), the engine's ``DistributedGPipe``.

This module holds what both share: the options, setup and teardown around the engine, the
meta-device init context. How a mini-batch runs through the pipeline is in ``pipeline_runner``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, ClassVar

import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from gpipe_lab.lightning.engine import PipelineEngine
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.pipeline_runner import PipelineRunnerMixin
from gpipe_lab.lightning.scaling import engine_nonfinite
from gpipe_lab.pipeline import Timeline
from gpipe_lab.pipeline.options import TRANSPORTS, OptionViews, PipelineOptions, forwarded
from gpipe_lab.pipeline.partitioning.materialize import is_meta

OPTION_NAMES = frozenset(f.name for f in fields(PipelineOptions))

__all__ = ["TRANSPORTS", "GPipeStrategy", "pipeline_options"]


def pipeline_options(options: PipelineOptions | None, stage_devices: Sequence[Any] | None,
                     overrides: dict[str, Any]) -> PipelineOptions:
    """``options`` (default ``PipelineOptions()``) with ``overrides`` and the ``stage_devices`` alias, checked.

    Raises:
        TypeError: ``options`` is not a ``PipelineOptions``.
        OptionError: an unknown option name, or a value that cannot run, naming it.
    """
    if options is not None and not isinstance(options, PipelineOptions):
        raise TypeError(f"options must be a PipelineOptions, got {type(options).__name__}")
    changes = dict(overrides)
    if stage_devices is not None:
        changes["devices"] = [str(d) for d in stage_devices]
    if isinstance(changes.get("balance"), Sequence) and not isinstance(changes["balance"], str):
        changes["balance"] = list(changes["balance"])
    return (options or PipelineOptions()).replace(**changes).check()


class GPipeStrategy(OptionViews, PipelineRunnerMixin, ParallelStrategy):
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
        OptionError: (a ``ValueError``) an unknown option name or a value that cannot run, naming it.
        TypeError: ``options`` is not a ``PipelineOptions``.
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
            cls = GPipeStrategy.by_transport[pipeline_options(options, stage_devices, overrides).transport]
        return super().__new__(cls)

    def __init__(self, options: PipelineOptions | None = None, *, stage_devices: Sequence[Any] | None = None,
                 process_group_backend: str | None = None, accelerator: Any = None, parallel_devices: Any = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 **option_overrides: Any) -> None:
        self.options = pipeline_options(options, stage_devices, option_overrides)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, **self.transport_arguments(process_group_backend))
        self.pipe: PipelineEngine | None = None
        self.init_runner()

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
    def output_device(self) -> torch.device:
        """Device of the last stage (where the loss and the outputs live)."""
        return self.root_device

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


StrategyRegistry.register("gpipe", GPipeStrategy, description="GPipe pipeline parallelism",
                          override=True)

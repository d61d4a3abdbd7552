"""``GPipe``: a layer sequence cut into K partitions, trained on M micro-batches (threads, or
stage processes on this machine: ``local_stages``).

    pipe = GPipe(nn.Sequential(...), partitions=2, chunks=8)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)   # grads in the module's params
    optimizer.step()

    out = pipe(x); criterion(out, y).backward()             # the same, torchgpipe-style

The loss and the gradients equal those of the unpipelined module on the full
batch, for every K, M, v, schedule and checkpoint mode (BatchNorm aside: see
``DeferredBatchNorm``). The step itself is ``core.PipelineCore``'s; this front
door cuts the module, places the stages on devices and opens a ``LocalChannel``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_lab.pipeline.devices.allocator import retain_freed_memory
from gpipe_lab.pipeline.devices.assignment import resolve_devices
from gpipe_lab.pipeline.devices.cpu_share import default_threads, usable_cores, warn_if_oversubscribed
from gpipe_lab.pipeline.microbatch import Value
from gpipe_lab.pipeline.options import (
    CHECKPOINT_MODES,
    NONFINITE_POLICIES,
    OptionError,
    PipelineOptions,
    merged_options,
)
from gpipe_lab.pipeline.partitioning.materialize import InitFn, build_module, place_layers
from gpipe_lab.pipeline.partitioning.partition import resolve_balance, split_module
from gpipe_lab.pipeline.processes.pool import ProcessExecutor, choose_local_stages
from gpipe_lab.pipeline.schedules import schedule_placement
from gpipe_lab.pipeline.skip.layout import skip_layout
from gpipe_lab.pipeline.skip.transport import attach
from gpipe_lab.pipeline.stage.batchnorm import DeferredBatchNorm
from gpipe_lab.pipeline.stage.dropout import convert_dropout
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.autograd_forward import pipeline_forward
from gpipe_lab.pipeline.step.batching import checkpointed_microbatches
from gpipe_lab.pipeline.step.clipping import clip_grad_norm_
from gpipe_lab.pipeline.step.core import PipelineCore
from gpipe_lab.pipeline.step.local_channel import LocalChannel
from gpipe_lab.pipeline.step.nonfinite import NonFiniteError

__all__ = ["CHECKPOINT_MODES", "NONFINITE_POLICIES", "GPipe", "NonFiniteError", "checkpointed_microbatches",
           "resolve_devices"]


class GPipe(PipelineCore):
    """Pipeline-parallel wrapper of an ``nn.Sequential`` (local transport: one thread per rank, or
    with ``local_stages="processes"`` every rank but the last in a stage process of its own;
    ``close()`` stops those).

    Every option is a ``PipelineOptions`` field: pass ``options=PipelineOptions(...)``,
    and/or any field as a keyword (``partitions=2, chunks=8``), which overrides that field
    of ``options``; ``balance`` may also come second, as in torchgpipe. With
    ``virtual_stages`` v, rank k holds chunks k, k+K, ... (or, for the V-shaped schedules, chunks
    k and 2K-1-k: the schedule's placement). See ``PipelineOptions`` for each.

    ``module`` may be built on the ``meta`` device (or be a factory, called under
    ``torch.device("meta")``): each stage's layers are then allocated on the stage's own
    device and initialized there, by ``init_fn(layer_index, layer)`` or by
    ``reset_parameters()`` under the seed ``seed + layer_index`` (``seeded_init`` gives an
    unpipelined model the same weights); the whole model is never allocated in one place.

    ``sample``: one micro-batch of inputs (a tensor or a tuple, where the module's layers are) that
    the automatic balance measures its cost on (``cost="auto"``, the default: FLOPs on it; without
    it, parameters; ``flops``, ``activation_bytes``, ``output_bytes`` and ``time`` need it).

    Sequence-like: ``len(pipe)``, ``pipe[i]`` and iteration give the module's layers;
    ``partitions``, ``balance``, ``devices``, ``chunks``, ``checkpoint`` are read-only.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` (nor a factory returning one).
        OptionError: an option outside its allowed values (the message names the key).
        ValueError: balance / partitions / devices inconsistent with the module,
            parameters shared across partitions, or a layer only partly on ``meta``.
            Messages name the values.
    """

    def __init__(self, module: nn.Sequential | Callable[[], nn.Sequential], balance: Sequence[int] | None = None,
                 *, options: PipelineOptions | None = None, init_fn: InitFn | None = None,
                 sample: Any = None, **option_overrides: Any) -> None:
        super().__init__()
        if isinstance(module, nn.Sequential) and len(module) == 0:
            # torchgpipe runs GPipe(nn.Sequential(), []) as the identity; a pipeline here has >= 1 stage
            raise ValueError("the module has no layers: a pipeline needs at least one; for the identity "
                             "(what torchgpipe makes of an empty nn.Sequential) pass "
                             "nn.Sequential(nn.Identity()) with balance=[1]")
        if balance is not None:
            option_overrides["balance"] = balance
        opts = merged_options(options, option_overrides).check()
        if opts.transport != "local":
            raise OptionError(f"transport: GPipe runs the local transport (a thread per stage), got "
                              f"{opts.transport!r}; use DistributedGPipe for a process per stage")
        if not isinstance(module, nn.Module) and callable(module):
            module = build_module(module)
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"GPipe needs an nn.Sequential, got {type(module).__name__}")
        v = opts.virtual_stages
        balance = resolve_balance(module, opts, sample=sample)
        K = len(balance) // v
        layout = skip_layout(list(module), balance)  # checked before anything is placed
        self._balance = list(balance)
        self._devices = resolve_devices(opts.devices, K)
        self.seed = int(torch.initial_seed() if opts.seed is None else opts.seed)
        opts = opts.replace(balance=list(balance), partitions=K, seed=self.seed)
        self.deferred_batch_norm = opts.deferred_batch_norm
        if opts.deferred_batch_norm:
            DeferredBatchNorm.convert(module)
        convert_dropout(module)
        self.module = module
        self._partitions = split_module(module, self._balance)
        placement = schedule_placement(opts.schedule, K, v)  # the rank of each stage, as the schedule places it
        chunk_devices = [self._devices[placement[j]] for j in range(len(self._partitions))]
        for j, (part, device) in enumerate(zip(self._partitions, chunk_devices)):
            place_layers(part, sum(self._balance[:j]), device, self.seed, init_fn)
        cpu_stages = sum(d.type == "cpu" for d in self._devices)
        if cpu_stages and opts.retain_cpu_memory:
            retain_freed_memory()
        self.threads_per_stage = opts.threads_per_stage or (default_threads(cpu_stages) if cpu_stages
                                                            else usable_cores())
        if cpu_stages:
            warn_if_oversubscribed(cpu_stages, self.threads_per_stage)
        self.stages = [StageRuntime(j, len(self._partitions), part, dev, self.seed)
                       for j, (part, dev) in enumerate(zip(self._partitions, chunk_devices))]
        runtimes = dict(enumerate(self.stages))
        attach(runtimes, layout)
        # the stage processes link neighbouring ranks only, each chunk on rank j mod K
        looped = all(rank == j % K for j, rank in enumerate(placement))
        mode = choose_local_stages(opts, self._devices, looped=looped, skips=bool(layout.pairs()))
        self._start_core(opts, runtimes, LocalChannel(runtimes, placement, self.threads_per_stage, float(opts.timeout)), K)
        if mode != "threads":
            self.executor = ProcessExecutor(self.executor, K, self.options, self.threads_per_stage, mode)

    # ------------------------------------------------------------ read-only views
    @property
    def balance(self) -> list[int]:
        """Layers per partition (K·v entries with virtual stages)."""
        return list(self._balance)

    @property
    def devices(self) -> list[torch.device]:
        """One device per pipeline rank."""
        return list(self._devices)

    @property
    def partitions(self) -> list[nn.Sequential]:
        """The stage modules (K, or K·v chunks with virtual stages), sharing the module's layers."""
        return list(self._partitions)

    def __len__(self) -> int:
        return len(self.module)

    def __getitem__(self, index: int) -> nn.Module:
        return self.module[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.module)

    @property
    def local_stages(self) -> str:
        """How the ranks run: ``threads``, ``processes``, or ``auto`` while its trial runs
        (``PipelineOptions.local_stages``)."""
        return self.executor.mode if isinstance(self.executor, ProcessExecutor) else "threads"

    def close(self) -> None:
        """Stop the stage processes (``local_stages="processes"``; a later step starts new ones).
        Nothing to do for threads. Collecting the pipe does the same."""
        if isinstance(self.executor, ProcessExecutor):
            self.executor.close()

    # ------------------------------------------------------------ running
    def forward(self, inputs: Value) -> Value:  # noqa: D401 - nn.Module API
        """The pipelined output.

        In training mode with gradients enabled the output is differentiable: its
        backward runs the fill-drain backward through the stages (re-materializing
        as ``checkpoint`` says), fills the parameters' and the input's gradients and
        commits deferred BatchNorm statistics. Otherwise (``no_grad``,
        ``inference_mode``, eval mode) no graph is built.

        Raises:
            RuntimeError (on backward): the schedule needs the loss inside the pipeline.
        """
        return pipeline_forward(self, inputs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every stage's gradients by their global 2-norm (``clipping.clip_grad_norm_``);
        returns the norm before clipping.

        Raises:
            ValueError: ``max_norm`` is not a positive finite number.
        """
        return clip_grad_norm_(self.parameters(), max_norm, device=self.devices[0])

    def memory(self) -> list[dict[str, int]]:
        """Per stage: parameter bytes, the last step's peak saved-activation bytes and, for a
        stage on a GPU, ``device_peak_bytes``: ``torch.cuda.max_memory_allocated`` of its
        device (shared by the stages on that device; reset it with
        ``torch.cuda.reset_peak_memory_stats``)."""
        rows = []
        for s in self.stages:
            row = {"parameter_bytes": s.parameter_bytes(), "peak_activation_bytes": s.peak_bytes}
            if s.device.type == "cuda":
                row["device_peak_bytes"] = torch.cuda.max_memory_allocated(s.device)
            rows.append(row)
        return rows

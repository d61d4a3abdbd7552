"""``DistributedGPipe``: one pipeline stage per process, D data-parallel replicas.

    dist.init_process_group("gloo")          # torchrun sets rank / world size
    pipe = DistributedGPipe(model, partitions=2, chunks=8, schedule="1f1b")
    loss = pipe.train_step(x, y, F.mse_loss)  # same batch on every rank of a replica
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()   # this rank's stage only

The step is ``core.PipelineCore``'s, as for ``GPipe``; this front door builds only
this rank's chunks and opens a ``P2PChannel`` to the other ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_lab.pipeline.devices.allocator import retain_freed_memory
from gpipe_lab.pipeline.devices.assignment import move_target
from gpipe_lab.pipeline.distributed.failure import AbortChannel, refuse_failed_group
from gpipe_lab.pipeline.distributed.grad_sync import BUCKET_BYTES, GradientSync
from gpipe_lab.pipeline.distributed.p2p_channel import P2PChannel
from gpipe_lab.pipeline.distributed.resolve import (
    agreed_balance,
    bind_device,
    local_placement,
    resolve_device,
    resolve_stages,
    shared_seed,
    stage_device,
    to_cpu,
)
from gpipe_lab.pipeline.distributed.state_dict import (
    by_index,
    by_name,
    gather_full_state_dict,
    local_state_dict,
)
from gpipe_lab.pipeline.distributed.topology import (
    add_links,
    barrier,
    build_topology,
    connect_groups,
    connect_links,
)
from gpipe_lab.pipeline.measuring.step_timeline import Event, Timeline
from gpipe_lab.pipeline.microbatch import Value
from gpipe_lab.pipeline.options import PipelineOptions, forwarded, merged_options
from gpipe_lab.pipeline.partitioning.materialize import InitFn, build_module, local_chunks
from gpipe_lab.pipeline.partitioning.partition import split_module
from gpipe_lab.pipeline.schedules import schedule_placement
from gpipe_lab.pipeline.skip.layout import skip_layout
from gpipe_lab.pipeline.skip.transport import attach, skip_links
from gpipe_lab.pipeline.stage.batchnorm import DeferredBatchNorm
from gpipe_lab.pipeline.stage.dropout import convert_dropout
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.autograd_forward import refuse_backward, wants_graph
from gpipe_lab.pipeline.step.clipping import clip_grad_norm_
from gpipe_lab.pipeline.step.core import PipelineCore


class DistributedGPipe(PipelineCore):
    """Pipeline (K ranks) × data parallel (D replicas) training of an ``nn.Sequential``.

    Options are ``GPipe``'s (``options=PipelineOptions(...)`` and/or any field as a
    keyword, overriding it); in addition ``device`` (default ``cuda:<local
    rank>`` with NCCL, else CPU), ``data_parallel_size`` (default world size / K),
    ``init_fn`` for meta-built layers, ``bucket_bytes`` for the gradient
    all-reduce and ``sample`` for a measured cut (rank 0's cut is every rank's). ``module`` may be
    built on ``meta`` or be a factory. With ``virtual_stages`` v the model is cut into K·v chunks,
    chunk j on rank j mod K (the V-shaped schedules: chunks k and 2K-1-k on rank k; the schedule's
    placement).

    ``nonfinite`` is decided by ALL ranks together: each rank's verdict on its loss
    and its stages' gradients travels with the loss all-reduce, so every rank
    raises the same ``NonFiniteError`` or every rank skips the step.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError: ``module`` is not an ``nn.Sequential``.
        OptionError: an option outside its allowed values (the message names the key).
        ValueError: world size not divisible by K (both numbers named), a balance
            inconsistent with the module, or one that puts a shared parameter's layers in two
            chunks (on every rank, before any step).
        GroupUnusableError: a step failed earlier on this process group (a new pipe is refused at
            once, and so is a failed pipe's next ``train_step`` or ``pipe(x)``): restart the processes.
    """

    def __init__(self, module: nn.Module | Callable[[], nn.Module], balance: Sequence[int] | None = None,
                 *, options: PipelineOptions | None = None, device: str | torch.device | None = None,
                 data_parallel_size: int | None = None, init_fn: InitFn | None = None,
                 bucket_bytes: int = BUCKET_BYTES, sample: Any = None, **option_overrides: Any) -> None:
        super().__init__()
        refuse_failed_group()  # before any exchange: one on a failed group would wait for ever
        if balance is not None:
            option_overrides["balance"] = balance
        opts = merged_options(options, option_overrides).check()
        v = opts.virtual_stages
        full = build_module(module)
        balance, num_stages = resolve_stages(full, opts, data_parallel_size, sample)
        # the schedule's placement: which rank holds each virtual stage
        placement = schedule_placement(opts.schedule, num_stages, v)
        self.topo = topo = build_topology(num_stages, v, data_parallel_size, placement)
        if device is None:
            device = stage_device(opts.devices, topo, *local_placement())
        self.device = resolve_device(device)
        if self.device.type == "cpu" and opts.threads_per_stage is not None:
            torch.set_num_threads(opts.threads_per_stage)  # this process is one stage
        bind_device(self.device)  # the main thread's collectives run on this rank's GPU, not cuda:0
        self.balance = balance = agreed_balance(balance, self.device)
        split_module(full, balance)  # refuses a parameter shared across chunks, as GPipe; every rank alike
        layout = skip_layout(list(full), balance)
        add_links(topo, skip_links(layout, placement))  # a link per stage pair a long skip joins
        connect_links(topo, self.device)
        connect_groups(topo, self.device)
        if self.device.type == "cpu" and opts.retain_cpu_memory:
            retain_freed_memory()
        self.seed = shared_seed(opts.seed, self.device)
        opts = opts.replace(balance=list(balance), partitions=num_stages, seed=self.seed, transport="distributed")
        if opts.deferred_batch_norm:
            DeferredBatchNorm.convert(full)
        convert_dropout(full)
        self._layer_names = list(full._modules)  # the original names: checkpoints keep them
        self._chunks = local_chunks(full, balance, topo.chunk_ids, self.device, self.seed, init_fn)
        self.local = nn.ModuleDict({str(j): part for j, (_, part) in self._chunks.items()})
        runtimes = {j: StageRuntime(j, num_stages * v, part, self.device, self.seed)
                    for j, (_, part) in self._chunks.items()}
        self.abort = AbortChannel(dist.distributed_c10d._get_default_store(), topo.rank, topo.stage_index)
        self.grad_sync = GradientSync(topo.dp_group, topo.dp_size, self.abort, float(opts.timeout), bucket_bytes)
        attach(runtimes, layout)
        channel = P2PChannel(topo, runtimes, self.device, self.abort, float(opts.timeout), self.grad_sync, layout)
        self._start_core(opts, runtimes, channel, num_stages, topo.dp_size)
        barrier(topo.pp_group, self.device)
        self._clock_zero = time.perf_counter()  # aligned across the pipeline's ranks by the barrier

    # ------------------------------------------------------------ properties
    stage_index = forwarded("topo.stage_index", "This rank's stage (its first chunk's index).")
    dp_rank = forwarded("topo.dp_rank", "This rank's data-parallel replica.")
    dp_size = forwarded("topo.dp_size", "D: replicas of the whole pipeline.")
    pp_group = forwarded("topo.pp_group", "This pipeline's process group.")
    dp_group = forwarded("topo.dp_group", "The process group of this stage's replicas (gradient all-reduce).")

    @property
    def stage_module(self) -> nn.Module:
        """This rank's layers: its chunk, or a ``ModuleDict`` of its v chunks."""
        return next(iter(self.local.values())) if self.virtual_stages == 1 else self.local

    @property
    def partitions(self) -> list[nn.Module]:
        """This rank's chunks (the other stages live in other processes)."""
        return [part for _, part in self._chunks.values()]

    @property
    def devices(self) -> list[torch.device]:
        """This rank's device (one entry: the others' are theirs)."""
        return [self.device]

    @property
    def is_last_stage(self) -> bool:
        return self.topo.rank == self.topo.last_rank

    # ------------------------------------------------------------ stepping
    def forward(self, inputs: Value | None, broadcast: bool = True) -> Value | None:  # noqa: D401
        """Forward only; the output is on the last stage, and on every rank of the
        pipeline with ``broadcast`` (the default). Every rank of the pipeline calls it.

        A batch smaller than ``chunks`` runs in fewer micro-batches only on ranks given
        ``inputs`` (pass the batch to every rank when it may be short). The output
        cannot be back-propagated (its backward says to use ``train_step``).
        """
        outputs = self.forward_only(inputs)
        if broadcast and self.num_stages > 1:
            box = [to_cpu(outputs) if self.is_last_stage else None]
            dist.broadcast_object_list(box, src=self.topo.last_rank, group=self.pp_group,
                                       device=self.device if self.device.type == "cuda" else None)
            outputs = outputs if self.is_last_stage else cast("Value | None", move_target(box[0], self.device))
        if outputs is not None and wants_graph(self):
            outputs = refuse_backward(outputs, "DistributedGPipe cannot back-propagate pipe(x) across "
                                      "processes; use pipe.train_step(x, y, loss_fn)")
        return outputs

    # ------------------------------------------------------------ reporting
    def gather_timeline(self, on_device: bool = False) -> Timeline:
        """The whole pipeline's last step on one clock, on every rank (collective over the pipeline).

        ``on_device``: each rank on a GPU contributes its actions timed by CUDA events
        (``Timeline.on_device``: anchored to its host clock by an event that ran, no host
        ``wait`` events); a CPU rank contributes its host events, waits included.

        Raises:
            RuntimeError: no step has run yet.
        """
        return self.gather_report(on_device)[0]

    def gather_report(self, on_device: bool = False) -> tuple[Timeline, list[dict[str, int]]]:
        """``gather_timeline`` and every stage's ``memory()`` rows (stage order) in ONE exchange over
        the pipeline (each ``all_gather_object`` is a blocking exchange; a step report needs both).

        Raises:
            RuntimeError: no step has run yet.
        """
        if self.timeline is None:
            raise RuntimeError("gather_timeline() needs a step first (train_step or forward)")
        t = self.timeline.on_device() if on_device else self.timeline
        z = self._clock_zero
        mine = Timeline(t.num_stages, t.start - z, t.end - z,
                        [Event(e.stage, e.kind, e.microbatch, e.start - z, e.end - z) for e in t.events],
                        t.num_microbatches)
        every: list[Any] = [None] * self.num_stages
        dist.all_gather_object(every, (mine, self.memory()), group=self.pp_group)
        merged = Timeline.merge([timeline for timeline, _ in every])
        merged.num_microbatches = t.num_microbatches
        rows = sorted((row for _, rank_rows in every for row in rank_rows), key=lambda r: r.get("stage", 0))
        return merged, rows

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip by the global 2-norm over every stage of this pipeline (collective over the
        pipeline group; ``clipping.clip_grad_norm_``); returns the norm before clipping.

        Raises:
            ValueError: ``max_norm`` is not a positive finite number.
        """
        group = self.pp_group if self.num_stages > 1 else None
        return clip_grad_norm_(self.parameters(), max_norm, group=group, device=self.device)

    def memory(self) -> list[dict[str, int]]:
        """Per local chunk: parameter bytes, peak saved-activation bytes, peak live micro-batches."""
        return [{"stage": j, "parameter_bytes": r.parameter_bytes(), "peak_activation_bytes": r.peak_bytes,
                 "peak_live_microbatches": self.channel.peak_live.get(j, 0)}
                for j, r in self.runtimes.items()]

    def full_state_dict(self) -> dict[str, Tensor] | None:
        """The unpipelined module's state dict on global rank 0 (``None`` elsewhere), under its own
        layer names; collective."""
        full = gather_full_state_dict(self._chunks, self.pp_group, self.topo.pp_ranks, self.dp_rank)
        return None if full is None else by_name(full, self._layer_names)

    def load_full_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load this rank's chunks from a full (unpipelined) state dict, keyed by the module's layer
        names (or by layer index); other keys are ignored."""
        indexed = by_index(state_dict, self._layer_names)
        for first, part in self._chunks.values():
            part.load_state_dict(local_state_dict(indexed, first, len(part)))

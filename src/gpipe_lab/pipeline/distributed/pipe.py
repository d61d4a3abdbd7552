"""``DistributedGPipe``: one pipeline stage per process, D data-parallel replicas.

    dist.init_process_group("gloo")          # torchrun sets rank / world size
    pipe = DistributedGPipe(model, partitions=2, chunks=8, schedule="1f1b")
    loss = pipe.train_step(x, y, F.mse_loss)  # same batch on every rank of a replica
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()   # this rank's stage only

Every rank builds the same schedule lists and runs its own with the shared
``StageRuntime``; loss and gradients equal the unpipelined module's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_lab.pipeline.allocator import retain_freed_memory
from gpipe_lab.pipeline.batchnorm import DeferredBatchNorm
from gpipe_lab.pipeline.distributed.executor import RankExecutor
from gpipe_lab.pipeline.distributed.failure import AbortChannel, wait_works
from gpipe_lab.pipeline.distributed.grad_sync import BUCKET_BYTES, GradientSync
from gpipe_lab.pipeline.distributed.links import message_plan
from gpipe_lab.pipeline.distributed.materialize import InitFn, build_module, local_chunks
from gpipe_lab.pipeline.distributed.setup import resolve_balance, resolve_device, shared_seed
from gpipe_lab.pipeline.distributed.state import gather_full_state_dict, local_state_dict
from gpipe_lab.pipeline.distributed.topology import build_topology
from gpipe_lab.pipeline.distributed.verdict import describe_problem, verdict_vector
from gpipe_lab.pipeline.dropout import convert_dropout
from gpipe_lab.pipeline.finite import NONFINITE_POLICIES, NonFiniteError
from gpipe_lab.pipeline.gpipe import checkpointed_microbatches
from gpipe_lab.pipeline.interleaved import rank_schedule
from gpipe_lab.pipeline.microbatch import Value, as_tuple, join, split, unwrap
from gpipe_lab.pipeline.schedule import weight_runs
from gpipe_lab.pipeline.stage import StageRuntime, StepPlan
from gpipe_lab.pipeline.timeline import Event, Timeline


class DistributedGPipe(nn.Module):
    """Pipeline (K ranks) × data parallel (D replicas) training of an ``nn.Sequential``.

    Args mirror ``GPipe``; in addition ``device`` (default ``cuda:<local rank>``
    with NCCL, else CPU), ``data_parallel_size`` (default world size / K),
    ``virtual_stages`` v (the model is cut into K·v chunks, chunk j on pipeline
    rank j mod K), ``init_fn`` for meta-built layers and ``bucket_bytes`` for
    the gradient all-reduce. ``module`` may be built on ``meta`` or be a factory.

    ``nonfinite`` is ``GPipe``'s policy for a NaN/inf loss or gradient (``"raise"``,
    ``"skip"``, ``"ignore"``), decided by ALL ranks together: each rank's verdict on
    its loss and its stages' gradients travels with the loss all-reduce, so every rank
    raises the same ``NonFiniteError`` (naming the step and the stage), or every rank
    drops its gradients and sets ``last_step_skipped``. ``retain_cpu_memory`` is ``GPipe``'s too.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: world size not divisible by K (both numbers named), bad
            balance / chunks / checkpoint / schedule / timeout / nonfinite policy.
    """

    def __init__(self, module: nn.Module | Callable[[], nn.Module], balance: Sequence[int] | None = None,
                 partitions: int | None = None, chunks: int = 1, checkpoint: str = "except_last",
                 schedule: str = "gpipe", deferred_batch_norm: bool = False, cost: object = None,
                 seed: int | None = None, device: str | torch.device | None = None,
                 data_parallel_size: int | None = None, timeout: float = 300.0, virtual_stages: int = 1,
                 init_fn: InitFn | None = None, bucket_bytes: int = BUCKET_BYTES,
                 nonfinite: str = "raise", retain_cpu_memory: bool = True) -> None:
        super().__init__()
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"unknown nonfinite policy {nonfinite!r}; allowed: {list(NONFINITE_POLICIES)}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
        checkpointed_microbatches(checkpoint, 1)
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        full = build_module(module)
        balance, num_stages = resolve_balance(full, balance, partitions, virtual_stages, cost,
                                              data_parallel_size)
        rank_schedule(schedule, num_stages, 1, virtual_stages)  # validates the name early
        self.topo = topo = build_topology(num_stages, virtual_stages, data_parallel_size)
        self.balance, self.chunks, self.checkpoint = balance, chunks, checkpoint
        self.schedule, self.timeout, self.virtual_stages = schedule, float(timeout), virtual_stages
        self.device = resolve_device(device)
        if self.device.type == "cpu" and retain_cpu_memory:
            retain_freed_memory()
        self.seed = shared_seed(seed, self.device)
        if deferred_batch_norm:
            DeferredBatchNorm.convert(full)
        convert_dropout(full)
        chunk_ids = [topo.stage_index + c * num_stages for c in range(virtual_stages)]
        self._chunks = local_chunks(full, balance, chunk_ids, self.device, self.seed, init_fn)
        self.local = nn.ModuleDict({str(j): part for j, (_, part) in self._chunks.items()})
        num_virtual = num_stages * virtual_stages
        self.runtimes = {j: StageRuntime(j, num_virtual, part, self.device, self.seed)
                         for j, (_, part) in self._chunks.items()}
        self.abort = AbortChannel(dist.distributed_c10d._get_default_store(), topo.rank)
        self.executor = RankExecutor(topo, self.runtimes, self.device, self.abort, self.timeout)
        self.grad_sync = GradientSync(topo.dp_group, topo.dp_size, self.abort, self.timeout, bucket_bytes)
        self._plans: dict[tuple[int, bool], tuple] = {}
        self.step_count = 0
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.timeline: Timeline | None = None
        dist.barrier(group=topo.pp_group)
        self._clock_zero = time.perf_counter()  # aligned across the pipeline's ranks by the barrier

    # ------------------------------------------------------------ properties
    @property
    def num_stages(self) -> int:
        return self.topo.num_stages

    @property
    def stage_index(self) -> int:
        return self.topo.stage_index

    @property
    def stage_module(self) -> nn.Module:
        """This rank's layers: its chunk, or a ``ModuleDict`` of its v chunks."""
        return next(iter(self.local.values())) if self.virtual_stages == 1 else self.local

    @property
    def dp_rank(self) -> int:
        return self.topo.dp_rank

    @property
    def dp_size(self) -> int:
        return self.topo.dp_size

    @property
    def pp_group(self) -> object:
        return self.topo.pp_group

    @property
    def dp_group(self) -> object:
        return self.topo.dp_group

    @property
    def is_last_stage(self) -> bool:
        return self.topo.rank == self.topo.last_rank

    # ------------------------------------------------------------ stepping
    def _plan(self, num_microbatches: int, forward_only: bool) -> tuple:
        key = (num_microbatches, forward_only)
        if key not in self._plans:
            name = "gpipe" if forward_only else self.schedule
            ranks = rank_schedule(name, self.num_stages, num_microbatches, self.virtual_stages)
            if forward_only:
                ranks = [[a for a in actions if a.kind == "F"] for actions in ranks]
            plan = message_plan(ranks, self.topo.pp_ranks, self.num_stages * self.virtual_stages)
            self._plans[key] = (ranks[self.stage_index], plan)
        return self._plans[key]

    def _execute(self, inputs: Value | None, targets: object, plan: StepPlan, forward_only: bool,
                 keep_outputs: bool) -> tuple[Tensor | None, Value | None]:
        M = plan.num_microbatches
        micro_inputs = None
        if inputs is not None and 0 in self.runtimes:
            micro_inputs = split(as_tuple(inputs, "inputs"), M, "inputs")
        micro_targets = None
        if targets is not None and self.is_last_stage:
            micro_targets = [unwrap(t, isinstance(targets, Tensor))
                             for t in split(as_tuple(targets, "targets"), M, "targets")]
        actions, links = self._plan(M, forward_only)
        plan.split_backward = frozenset(a.microbatch for a in actions if a.kind == "W")
        plan.weight_runs = weight_runs(actions)
        for runtime in self.runtimes.values():
            runtime.begin(plan, keep_outputs)
        timeline = Timeline(self.num_stages, start=time.perf_counter())

        def chunk_done(j: int) -> None:
            self.grad_sync.start(self.runtimes[j].module.parameters())

        try:
            self.executor.run(actions, links, micro_inputs, isinstance(inputs, Tensor), micro_targets,
                              chunk_done if not forward_only else (lambda j: None))
            self.grad_sync.finish()
        except BaseException:
            self.grad_sync.discard()
            for m in self.local.modules():
                if isinstance(m, DeferredBatchNorm):
                    m.reset_accumulators()
            raise
        finally:
            timeline.end = time.perf_counter()
            timeline.events = sorted((Event(e.stage % self.num_stages, e.kind, e.microbatch, e.start, e.end)
                                      for r in self.runtimes.values() for e in r.events),
                                     key=lambda e: e.start)
            self.timeline = timeline
        last = self.runtimes.get(self.num_stages * self.virtual_stages - 1)
        loss = outputs = None
        if last is not None and last.losses:
            loss = torch.stack([last.losses[i] for i in sorted(last.losses)]).sum()
        if last is not None and keep_outputs and last.outputs:
            parts = [last.outputs[i] for i in sorted(last.outputs)]
            outputs = unwrap(join([p[0] for p in parts]), parts[0][1])
        return loss, outputs

    def _weights(self, inputs: Value | None, targets: object,
                 loss_normalizer: Callable[[object], Tensor | float] | None) -> list[float]:
        if not self.is_last_stage:
            return []
        if targets is None:
            raise ValueError(f"rank {self.topo.rank} runs the last stage: train_step needs targets")
        sizes = [mb[0].shape[0] for mb in split(as_tuple(targets, "targets"), self.chunks, "targets")]
        if loss_normalizer is None:
            return [s / sum(sizes) for s in sizes]
        total = float(loss_normalizer(targets))
        if not total > 0:
            raise ValueError(f"loss_normalizer returned {total}; it must be positive")
        return [1.0 / total] * self.chunks

    def train_step(self, inputs: Value | None, targets: object, loss_fn: Callable[[object, object], Tensor],
                   loss_normalizer: Callable[[object], Tensor | float] | None = None,
                   return_outputs: bool = False, step: int | None = None) -> Tensor | tuple[Tensor, Value | None]:
        """Forward and backward of all micro-batches; this rank's gradients accumulate.

        Same semantics as ``GPipe.train_step``. Every rank calls it: the first stage
        needs ``inputs``, the last ``targets`` (others may pass ``None``). Gradients
        are averaged over the D replicas; the returned full-batch loss is the
        replicas' mean, on every rank. With ``return_outputs`` the last stage also
        gets its outputs (``None`` on other ranks).

        ``step`` numbers this step for the per-(step, stage, micro-batch) random generators
        (a trainer resuming at batch n passes n); default: ``step_count``, the steps run so far.

        Raises:
            ValueError: chunks larger than the batch, missing inputs/targets, a zero normalizer.
            Exception: what a layer raised, with rank, stage and micro-batch in the message.
            PeerFailedError, PeerTimeoutError: another rank failed, died or stopped answering.
        """
        if step is not None:
            self.step_count = step
        plan = StepPlan(self.step_count, self.chunks, checkpointed_microbatches(self.checkpoint, self.chunks),
                        loss_fn=loss_fn)
        try:
            plan.loss_weights = self._weights(inputs, targets, loss_normalizer)
        except BaseException as exc:
            self.abort.signal(f"rank {self.topo.rank} failed before its first action: {exc}")
            raise
        with torch.enable_grad():
            loss, outputs = self._execute(inputs, targets, plan, False, return_outputs)
        shared = verdict_vector(loss, self.runtimes, self.num_stages * self.virtual_stages, self.dp_size,
                                self.nonfinite != "ignore", self.device)
        wait_works([dist.all_reduce(shared, async_op=True)], "sharing the loss", None, self.timeout, self.abort)
        total = shared[0].clone()
        self._apply_policy(describe_problem(shared, self.num_stages, self.virtual_stages))
        if not self.last_step_skipped:
            for m in self.local.modules():
                if isinstance(m, DeferredBatchNorm):
                    m.commit()
        self.step_count += 1
        return (total, outputs) if return_outputs else total

    def _apply_policy(self, problem: str | None) -> None:
        """Raise, or skip the step (drop the gradients), on every rank alike."""
        self.last_step_skipped = False
        if problem is None:
            return
        for m in self.local.modules():
            if isinstance(m, DeferredBatchNorm):
                m.reset_accumulators()
        if self.nonfinite == "raise":
            raise NonFiniteError(f"step {self.step_count}: {problem} (set nonfinite='skip' to skip such steps)")
        self.local.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.last_step_skipped = True

    def forward(self, inputs: Value | None, broadcast: bool = True) -> Value | None:  # noqa: D401
        """Evaluation forward; the output is on the last stage, and on every rank of the
        pipeline with ``broadcast`` (the default). Every rank of the pipeline calls it."""
        M = self.chunks
        if inputs is not None:
            M = min(M, as_tuple(inputs, "inputs")[0].shape[0])
        with torch.no_grad():
            _, outputs = self._execute(inputs, None, StepPlan(self.step_count, M, frozenset(), grad_enabled=False), True, True)
        if broadcast and self.num_stages > 1:
            box = [outputs if self.is_last_stage else None]
            dist.broadcast_object_list(box, src=self.topo.last_rank, group=self.pp_group,
                                       device=self.device if self.device.type == "cuda" else None)
            outputs = box[0]
        return outputs

    # ------------------------------------------------------------ reporting
    def gather_timeline(self) -> Timeline:
        """The whole pipeline's last step on one clock, on every rank (collective over the pipeline).

        Raises:
            RuntimeError: no step has run yet.
        """
        if self.timeline is None:
            raise RuntimeError("gather_timeline() needs a step first (train_step or forward)")
        t = self.timeline
        z = self._clock_zero
        mine = Timeline(t.num_stages, t.start - z, t.end - z,
                        [Event(e.stage, e.kind, e.microbatch, e.start - z, e.end - z) for e in t.events])
        every: list[object] = [None] * self.num_stages
        dist.all_gather_object(every, mine, group=self.pp_group)
        return Timeline.merge(every)  # type: ignore[arg-type]

    def memory(self) -> list[dict[str, int]]:
        """Per local chunk: parameter bytes, peak saved-activation bytes, peak live micro-batches."""
        return [{"stage": j, "parameter_bytes": r.parameter_bytes(), "peak_activation_bytes": r.peak_bytes,
                 "peak_live_microbatches": self.executor.peak_live.get(j, 0)}
                for j, r in self.runtimes.items()]

    def full_state_dict(self) -> dict[str, Tensor] | None:
        """The unpipelined module's state dict on global rank 0 (``None`` elsewhere); collective."""
        return gather_full_state_dict(self._chunks, self.pp_group, self.topo.pp_ranks, self.dp_rank)

    gather_state_dict = full_state_dict

    def load_full_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load this rank's chunks from a full (unpipelined) state dict; other keys are ignored."""
        for first, part in self._chunks.values():
            part.load_state_dict(local_state_dict(state_dict, first, len(part)))

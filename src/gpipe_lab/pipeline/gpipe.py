"""``GPipe``: a layer sequence cut into K partitions, trained on M micro-batches.

    pipe = GPipe(nn.Sequential(...), partitions=2, chunks=8)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)   # grads in the module's params
    optimizer.step()

The loss and the gradients equal those of the unpipelined module on the full
batch, for every K, M, schedule and checkpoint mode (BatchNorm aside: see
``DeferredBatchNorm``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.allocator import retain_freed_memory
from gpipe_lab.pipeline.batchnorm import DeferredBatchNorm
from gpipe_lab.pipeline.dropout import convert_dropout
from gpipe_lab.pipeline.finite import NONFINITE_POLICIES, NonFiniteError, all_finite
from gpipe_lab.pipeline.local import LocalTransport
from gpipe_lab.pipeline.microbatch import Value, as_tuple, join, split, unwrap
from gpipe_lab.pipeline.partition import balance_by_cost, check_balance, layer_costs, split_module
from gpipe_lab.pipeline.schedule import SCHEDULES, Schedule, get_schedule, weight_runs
from gpipe_lab.pipeline.stage import StageRuntime, StepPlan
from gpipe_lab.pipeline.timeline import Timeline

CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpointed_microbatches(mode: str, num_microbatches: int) -> frozenset[int]:
    """Micro-batches whose activations are re-materialized in backward.

    Raises:
        ValueError: unknown mode.
    """
    if mode == "always":
        return frozenset(range(num_microbatches))
    if mode == "except_last":
        return frozenset(range(num_microbatches - 1))
    if mode == "never":
        return frozenset()
    raise ValueError(f"unknown checkpoint mode {mode!r}; allowed: {list(CHECKPOINT_MODES)}")


def resolve_devices(devices: Sequence[str | torch.device] | None, partitions: int) -> list[torch.device]:
    """One device per partition; default: CUDA GPUs when there are enough, else CPU.

    Raises:
        ValueError: fewer devices than partitions.
    """
    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= partitions:
            return [torch.device("cuda", k) for k in range(partitions)]
        return [torch.device("cpu")] * partitions
    devices = [torch.device(d) for d in devices]
    if len(devices) < partitions:
        raise ValueError(f"{partitions} partitions need {partitions} devices, got {len(devices)}: "
                         f"{[str(d) for d in devices]}")
    return devices[:partitions]


class GPipe(nn.Module):
    """Pipeline-parallel wrapper of an ``nn.Sequential`` (local transport: one thread per stage).

    Args:
        module: the layer sequence L_1..L_n.
        balance: layers per partition, e.g. ``[3, 5]``; or
        partitions: K, balanced automatically by ``cost``.
        devices: one per partition (``"cuda:0"``, ... or ``"cpu"`` repeated).
        chunks: M micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` re-materialization.
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"`` or any registered name.
        deferred_batch_norm: replace BatchNorm layers by ``DeferredBatchNorm``.
        cost: per-layer cost for automatic balance: ``"params"`` (default), a list, a callable.
        seed: base seed of the per-(step, stage, micro-batch) generators.
        threads_per_stage: intra-op threads of each CPU stage (default: cores / CPU stages).
        timeout: seconds a stage may wait for a neighbour before the step fails.
        nonfinite: a NaN/inf loss or gradient ``"raise"`` NonFiniteError naming the step and
            stage, ``"skip"`` the step (its gradients are dropped, ``last_step_skipped`` is
            set), or ``"ignore"``.
        track_memory: count saved-activation bytes per stage (``memory()``) with
            saved-tensor hooks; costs ~30 µs per action on tiny layers.
        retain_cpu_memory: with CPU stages, make glibc keep freed memory for the next
            step instead of returning it to the OS (``allocator.retain_freed_memory``,
            process-wide); without it every step page-faults its activations back in.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: inconsistent balance / partitions / devices / chunks / names, or
            parameters shared across partitions. Messages name the values.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | None = None,
                 partitions: int | None = None, devices: Sequence[str | torch.device] | None = None,
                 chunks: int = 1, checkpoint: str = "except_last", schedule: str = "gpipe",
                 deferred_batch_norm: bool = False, cost: object = None, seed: int | None = None,
                 threads_per_stage: int | None = None, timeout: float = 300.0,
                 nonfinite: str = "raise", track_memory: bool = True,
                 retain_cpu_memory: bool = True) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"GPipe needs an nn.Sequential, got {type(module).__name__}")
        if len(module) == 0:
            raise ValueError("the module has no layers")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
        checkpointed_microbatches(checkpoint, 1)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; allowed: {sorted(SCHEDULES)}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"unknown nonfinite policy {nonfinite!r}; allowed: {list(NONFINITE_POLICIES)}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if balance is None:
            if partitions is None:
                raise ValueError("give either balance=[layers per partition] or partitions=K")
            if not isinstance(partitions, int) or partitions < 1:
                raise ValueError(f"partitions must be an integer >= 1, got {partitions!r}")
            if partitions > len(module):
                raise ValueError(f"partitions={partitions} is more than the module's {len(module)} layers")
            balance = balance_by_cost(layer_costs(module, cost), partitions)
        else:
            balance = check_balance(balance, len(module))
            if partitions is not None and partitions != len(balance):
                raise ValueError(f"partitions={partitions} but balance {list(balance)} has {len(balance)} entries")
        self.balance = list(balance)
        self.devices = resolve_devices(devices, len(self.balance))
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.timeout = float(timeout)
        self.deferred_batch_norm = deferred_batch_norm
        if deferred_batch_norm:
            DeferredBatchNorm.convert(module)
        convert_dropout(module)
        self.module = module
        self.partitions = split_module(module, self.balance)
        for part, device in zip(self.partitions, self.devices):
            part.to(device)
        self.seed = int(torch.initial_seed() if seed is None else seed)
        cpu_stages = sum(d.type == "cpu" for d in self.devices)
        if cpu_stages and retain_cpu_memory:
            retain_freed_memory()
        self.threads_per_stage = threads_per_stage or max(1, (os.cpu_count() or 1) // max(1, cpu_stages))
        self.stages = [StageRuntime(k, len(self.balance), part, dev, self.seed)
                       for k, (part, dev) in enumerate(zip(self.partitions, self.devices))]
        for stage in self.stages:
            stage.track_memory = track_memory
        self.transport = LocalTransport(self.stages, self.threads_per_stage)
        self.nonfinite = nonfinite
        self.step_count = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.timeline: Timeline | None = None

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    def _schedule(self, num_microbatches: int, forward_only: bool) -> Schedule:
        if forward_only:
            return [[a for a in actions if a.kind == "F"]
                    for actions in get_schedule("gpipe", self.num_stages, num_microbatches)]
        return get_schedule(self.schedule, self.num_stages, num_microbatches)

    def _execute(self, inputs: Value, targets: object, plan: StepPlan, forward_only: bool,
                 keep_outputs: bool) -> tuple[Tensor | None, Value | None]:
        values = as_tuple(inputs, "inputs")
        micro_inputs = split(values, plan.num_microbatches, "inputs")
        micro_targets = None
        if targets is not None:
            target_values = as_tuple(targets, "targets")
            micro_targets = [unwrap(t, isinstance(targets, Tensor))
                             for t in split(target_values, plan.num_microbatches, "targets")]
        schedule = self._schedule(plan.num_microbatches, forward_only)
        split_mbs = {a.microbatch for a in schedule[-1] if a.kind == "W"}
        plan.split_backward = frozenset(split_mbs)
        plan.weight_runs = {k: weight_runs(actions).get(k, {}) for k, actions in enumerate(schedule)}
        for stage in self.stages:
            stage.begin(plan, keep_outputs)
        timeline = Timeline(self.num_stages)
        timeline.start = time.perf_counter()
        try:
            self.transport.run(schedule, micro_inputs, isinstance(inputs, Tensor), micro_targets,
                               self.timeout)
        except BaseException:
            self._reset_batch_norm()
            raise
        finally:
            timeline.end = time.perf_counter()
            timeline.events = sorted((e for s in self.stages for e in s.events), key=lambda e: e.start)
            self.timeline = timeline
        last = self.stages[-1]
        loss = torch.stack([last.losses[i] for i in sorted(last.losses)]).sum() if last.losses else None
        outputs = None
        if keep_outputs and last.outputs:
            parts = [last.outputs[i] for i in sorted(last.outputs)]
            outputs = unwrap(join([p[0] for p in parts]), parts[0][1])
        return loss, outputs

    def train_step(self, inputs: Value, targets: object, loss_fn: Callable[[object, object], Tensor],
                   loss_normalizer: Callable[[object], Tensor | float] | None = None,
                   return_outputs: bool = False, step: int | None = None) -> Tensor | tuple[Tensor, Value]:
        """Forward and backward of all micro-batches; gradients accumulate into the module.

        ``loss_fn(output_mb, target_mb)`` returns the micro-batch's mean loss; each is
        weighted by its share of the batch. With ``loss_normalizer``, ``loss_fn``
        returns the micro-batch's SUM and the total is divided by
        ``loss_normalizer(targets)`` (e.g. the number of non-pad tokens), exactly.

        Returns the full-batch loss (and the last stage's outputs if asked).

        ``step`` numbers this step for the per-(step, stage, micro-batch) random generators
        (a trainer resuming at batch n passes n); default: ``step_count``, the steps run so far.

        Raises:
            ValueError: chunks larger than the batch, a zero normalizer.
            Exception: whatever a layer raised, with its stage and micro-batch in the message.
        """
        chunks = self.chunks
        sizes = [mb[0].shape[0] for mb in split(as_tuple(inputs, "inputs"), chunks, "inputs")]
        if loss_normalizer is None:
            weights = [s / sum(sizes) for s in sizes]
        else:
            total = float(loss_normalizer(targets))
            if not total > 0:
                raise ValueError(f"loss_normalizer returned {total}; it must be positive")
            weights = [1.0 / total] * chunks
        if step is not None:
            self.step_count = step
        plan = StepPlan(self.step_count, chunks, checkpointed_microbatches(self.checkpoint, chunks),
                        loss_fn=loss_fn, loss_weights=weights)
        with torch.enable_grad():
            loss, outputs = self._execute(inputs, targets, plan, False, return_outputs)
        assert loss is not None
        self.last_step_skipped = False
        if self.nonfinite != "ignore":
            self._check_finite(loss)
        if not self.last_step_skipped:
            self._commit_batch_norm()
        self.step_count += 1
        return (loss, outputs) if return_outputs else loss  # type: ignore[return-value]

    def forward(self, inputs: Value) -> Value:  # noqa: D401 - nn.Module API
        """Forward only (evaluation): the pipelined output, without building a graph."""
        chunks = min(self.chunks, as_tuple(inputs, "inputs")[0].shape[0])
        plan = StepPlan(self.step_count, chunks, frozenset(), grad_enabled=False)
        with torch.no_grad():
            _, outputs = self._execute(inputs, None, plan, True, True)
        assert outputs is not None
        return outputs

    def _check_finite(self, loss: Tensor) -> None:
        """Apply the non-finite policy to the loss and each stage's gradients."""
        problem = None if bool(torch.isfinite(loss)) else f"loss is {loss.item()} (computed on stage {self.num_stages - 1})"
        if problem is None:
            for k, part in enumerate(self.partitions):
                if not all_finite(p.grad for p in part.parameters()):
                    problem = f"gradients of stage {k} are not finite"
                    break
        if problem is None:
            return
        if self.nonfinite == "raise":
            self._reset_batch_norm()
            raise NonFiniteError(f"step {self.step_count}: {problem} (set nonfinite='skip' to skip such steps)")
        self._reset_batch_norm()
        self.module.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.last_step_skipped = True

    def _commit_batch_norm(self) -> None:
        for m in self.module.modules():
            if isinstance(m, DeferredBatchNorm):
                m.commit()

    def _reset_batch_norm(self) -> None:
        for m in self.module.modules():
            if isinstance(m, DeferredBatchNorm):
                m.reset_accumulators()

    def memory(self) -> list[dict[str, int]]:
        """Per stage: parameter bytes and the last step's peak saved-activation bytes."""
        return [{"parameter_bytes": s.parameter_bytes(), "peak_activation_bytes": s.peak_bytes}
                for s in self.stages]

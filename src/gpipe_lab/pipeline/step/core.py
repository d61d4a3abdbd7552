"""The engine core: one step of a pipeline, whatever carries the tensors between stages.

Both front doors (``GPipe``: threads; ``DistributedGPipe``: one process per stage)
are this class plus a transport endpoint (``channel.Endpoint``). The core owns the
step: its micro-batching (min(chunks, batch) micro-batches), the loss weights, the
schedule (cached per micro-batch count), running the hosted ranks' action lists
through the one executor (``executor.Executor``), the non-finite policy with its
deferred-BatchNorm commit, and the timeline.

``pipe(x)``'s differentiable path (``autograd_forward``) runs the step in two halves, through
the public ``forward_half`` and ``backward_half``, so it gets the same policy as ``train_step``:
``forward_half`` runs fill-drain's forward half with graphs kept (or re-materialized later, per
``checkpoint``) and returns a ``HalfStep``; ``backward_half`` runs the backward half from the
caller's output gradients, then ends the step as ``train_step`` does. The step is counted at the
forward: a ``pipe(x)`` never back-propagated still draws fresh random numbers on the next call.

What ends a step is the same on every rank: each process builds its verdict vector
(``nonfinite``; a stage's gradient check is launched by its worker once its gradients are final,
overlapping earlier stages' backward: ``stage_flags``), the endpoint sums it over every rank, and
all ranks raise ``NonFiniteError`` or skip the step together. Under ``nonfinite="ignore"`` nothing
is checked; a process holding every stage then builds no vector and reads nothing from the device.
Deferred BatchNorm statistics are committed after a good step and dropped after a failed or skipped
one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.measuring.step_timeline import Timeline
from gpipe_lab.pipeline.microbatch import Value, as_tuple, join, unwrap
from gpipe_lab.pipeline.options import OptionViews, PipelineOptions, compile_kwargs
from gpipe_lab.pipeline.schedules import (
    Schedule,
    get_schedule,
    placed_fill_drain,
    schedule_placement,
    weight_runs,
)
from gpipe_lab.pipeline.stage.batchnorm import DeferredBatchNorm
from gpipe_lab.pipeline.stage.compiling import CompiledStage, split_backward_error
from gpipe_lab.pipeline.stage.replay_policy import StageReplay, StepGuard, generator_owners
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.stage.stage_state import LossFn, StepPlan
from gpipe_lab.pipeline.step.batching import (
    Normalizer,
    checkpointed_microbatches,
    input_gradients,
    input_leaves,
    loss_weights,
    make_feed,
    microbatch_count,
)
from gpipe_lab.pipeline.step.channel import Endpoint, StepFeed, Values
from gpipe_lab.pipeline.step.executor import Executor, StepRecord
from gpipe_lab.pipeline.step.nonfinite import (
    NonFiniteError,
    describe_problem,
    loss_dtype,
    read_verdict,
    verdict_vector,
)


class _Scheduled(NamedTuple):
    """A schedule as the core runs it, derived once per (micro-batch count, kind)."""

    lists: Schedule
    prepared: Any  # the endpoint's (``Endpoint.prepare``)
    split_backward: frozenset[tuple[int, int]]  # (stage, micro-batch) with a W on a hosted rank
    weight_runs: dict[int, dict[int, tuple[int, ...]]]  # ``schedules.weight_runs`` of the hosted ranks


class HalfStep(NamedTuple):
    """A ``pipe(x)`` step whose forward half ran (``PipelineCore.forward_half``)."""

    outputs: Value
    output_was_tensor: bool
    plan: StepPlan
    leaves: list[tuple[Tensor, ...]]  # each micro-batch's inputs, as leaves on the first stage's device
    sizes: list[int]  # each micro-batch's output batch size
    generation: int


def configure_stages(options: PipelineOptions, runtimes: dict[int, StageRuntime], owners: dict[int, str]) -> None:
    """Set each stage's memory counting, random replay (``owners``: ``generator_owners``) and
    compiling as ``options`` say; every process hosting stages does it once."""
    compiling = compile_kwargs(options.compile)
    for j, runtime in runtimes.items():
        runtime.track_memory = options.track_memory
        # dynamo does not trace under the per-op replay mode: a compiled stage checks its draws instead
        runtime.replay = StageReplay(options.random_replay if compiling is None else False, runtime.device,
                                     owners[j], runtime.module, j)
        if compiling is not None:
            runtime.compiled = CompiledStage(compiling)


class PipelineCore(OptionViews, nn.Module):
    """The step shared by every front door; a front door calls ``_start_core`` once built."""

    options: PipelineOptions
    runtimes: dict[int, StageRuntime]
    channel: Endpoint

    def _start_core(self, options: PipelineOptions, runtimes: dict[int, StageRuntime], channel: Endpoint,
                    num_ranks: int, dp_size: int = 1) -> None:
        """Attach the step to built stages.

        Raises:
            ValueError: the schedule has no form with ``options.virtual_stages`` (``OptionError``,
                checked with the options).
            OptionError: ``compile`` with a split-backward schedule.
        """
        v = options.virtual_stages
        #: the rank of each stage, as the schedule places them (the fill-drain halves keep it)
        self._placement = schedule_placement(options.schedule, num_ranks, v)
        self.options = options
        self.runtimes = runtimes
        compiling = compile_kwargs(options.compile)
        if compiling is not None:
            # 2K micro-batches: a size every built-in form runs (interleaved: a multiple of K; dualpipev: >= 2K)
            lists = get_schedule(options.schedule, num_ranks, 2 * num_ranks, v)
            if any(a.kind == "W" for actions in lists for a in actions):
                raise split_backward_error(options.schedule)
        configure_stages(options, runtimes, generator_owners({j: r.device for j, r in runtimes.items()},
                                                             self._placement, channel.holds_all_stages))
        self.channel = channel
        self.executor = Executor(channel, runtimes)
        self._num_ranks = num_ranks
        self._dp_size = dp_size
        self._schedules: dict[tuple[int, str], _Scheduled] = {}
        self.step_count = 0
        self.generation = 0  # bumped by every step begun: a pending pipe(x) graph belongs to one
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._record: StepRecord | None = None
        self._timeline: Timeline | None = None

    # ------------------------------------------------------------ options
    @property
    def num_stages(self) -> int:
        """K: pipeline ranks (each holds ``virtual_stages`` chunks)."""
        return self._num_ranks

    @property
    def timeout(self) -> float:
        """Seconds a stage may wait for a neighbour; settable between steps."""
        return float(self.options.timeout)

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.options = self.options.replace(timeout=seconds).check()
        self.channel.timeout = float(seconds)  # every wait reads it there: mailbox, sends, all-reduces

    @property
    def timeline(self) -> Timeline | None:
        """The last step's timeline (``None`` before the first step); built when first read."""
        if self._record is not None:
            self._timeline, self._record = self._record.timeline(), None
        return self._timeline

    @property
    def _last(self) -> StageRuntime | None:
        """The last (virtual) stage, if this process holds it."""
        return self.runtimes.get(self._num_virtual - 1)

    @property
    def _num_virtual(self) -> int:
        return self._num_ranks * self.options.virtual_stages

    # ------------------------------------------------------------ the step
    def _num_microbatches(self, inputs: object, targets: object) -> int:
        return microbatch_count(self.options.chunks, inputs, targets)

    def _schedule(self, num_microbatches: int, kind: str) -> _Scheduled:
        """``kind``: ``train`` (the configured schedule), ``forward`` or ``backward`` (fill-drain halves)."""
        key = (num_microbatches, kind)
        if key not in self._schedules:
            if kind == "train":
                lists = get_schedule(self.options.schedule, self._num_ranks, num_microbatches,
                                     self.options.virtual_stages)
            else:
                lists = placed_fill_drain(self._placement, num_microbatches)
                keep = "F" if kind == "forward" else "B"
                lists = [[a for a in actions if a.kind == keep] for actions in lists]
            mine = [a for k in self.channel.ranks for a in lists[k]]
            runs: dict[int, dict[int, tuple[int, ...]]] = {}
            for k in self.channel.ranks:
                runs.update(weight_runs(lists[k]))
            self._schedules[key] = _Scheduled(lists, self.channel.prepare(lists),
                                              frozenset((a.stage, a.microbatch) for a in mine if a.kind == "W"), runs)
        return self._schedules[key]

    def _feed(self, inputs: Value | None, targets: object, num_microbatches: int,
              leaves: bool = False) -> StepFeed:
        """``leaves``: the inputs' micro-batches become ``input_leaves`` on the first stage's device."""
        first = self.runtimes.get(0)
        return make_feed(inputs, targets, num_microbatches, first is not None, self._last is not None,
                         first.device if leaves and first is not None else None)

    def _execute(self, feed: StepFeed, plan: StepPlan, kind: str, keep_outputs: bool,
                 fresh: bool = True) -> tuple[Tensor | None, Value | None]:
        """Run one schedule over the channel; return the last stage's loss and outputs (if here).

        ``fresh=False`` continues the step the previous call began (the backward half).
        """
        lists, prepared, split_backward, runs = self._schedule(plan.num_microbatches, kind)
        self.executor.stage_flags.arm(self.options.nonfinite != "ignore")
        if fresh:
            plan.split_backward, plan.weight_runs = split_backward, runs  # read only by the stages
            for runtime in self.runtimes.values():
                runtime.begin(plan, keep_outputs)
            self.generation += 1
            self._step_start = time.perf_counter()
        guard = StepGuard([(r.replay, r.mode) for r in self.runtimes.values()])
        try:
            self.executor.run(lists, prepared, feed, sync_gradients=kind != "forward")
            guard.check(plan.step)
        except BaseException:
            self._reset_batch_norm()
            raise
        finally:
            self._record = StepRecord(self.runtimes, self._placement, self._step_start, plan.num_microbatches)
        last = self._last
        loss = outputs = None
        if last is not None and last.losses:
            loss = torch.stack([last.losses[i] for i in sorted(last.losses)]).sum()
        if last is not None and keep_outputs and last.outputs:
            parts = [last.outputs[i] for i in sorted(last.outputs)]
            outputs = unwrap(join([p[0] for p in parts]), parts[0][1])
        return loss, outputs

    def _loss_weights(self, inputs: object, targets: object, num_microbatches: int,
                      loss_normalizer: Normalizer | None) -> list[float | Tensor]:
        if self._last is None:
            return []
        if targets is None and not self.channel.holds_all_stages:
            raise ValueError("this rank runs the last stage: train_step needs targets")
        return loss_weights(inputs, targets, num_microbatches, loss_normalizer, self._last.device)

    @overload
    def train_step(self, inputs: Value | None, targets: object, loss_fn: LossFn,
                   loss_normalizer: Normalizer | None = None, return_outputs: Literal[False] = False,
                   step: int | None = None) -> Tensor: ...

    @overload
    def train_step(self, inputs: Value | None, targets: object, loss_fn: LossFn,
                   loss_normalizer: Normalizer | None, return_outputs: Literal[True],
                   step: int | None = None) -> tuple[Tensor, Value | None]: ...

    @overload
    def train_step(self, inputs: Value | None, targets: object, loss_fn: LossFn,
                   loss_normalizer: Normalizer | None = None, *, return_outputs: Literal[True],
                   step: int | None = None) -> tuple[Tensor, Value | None]: ...

    @overload
    def train_step(self, inputs: Value | None, targets: object, loss_fn: LossFn,
                   loss_normalizer: Normalizer | None = None, return_outputs: bool = False,
                   step: int | None = None) -> Tensor | tuple[Tensor, Value | None]: ...

    def train_step(self, inputs: Value | None, targets: object, loss_fn: LossFn,
                   loss_normalizer: Normalizer | None = None,
                   return_outputs: bool = False, step: int | None = None) -> Tensor | tuple[Tensor, Value | None]:
        """Forward and backward of all micro-batches; gradients accumulate into the module.

        ``loss_fn(output_mb, target_mb)`` returns the micro-batch's mean loss; each is
        weighted by its share of the batch. With ``loss_normalizer``, ``loss_fn``
        returns the micro-batch's SUM and the total is divided by
        ``loss_normalizer(targets)`` (e.g. the number of non-pad tokens), exactly.
        A batch smaller than ``chunks`` runs as that many micro-batches of one sample.

        Inputs that require grad (the output of a trainable front end of the caller's) get their
        gradient as from a plain backward: one backward of the caller's graph after the step's.

        ``step`` numbers this step for the per-(step, stage, micro-batch) random generators
        (a trainer resuming at batch n passes n); default: ``step_count``, the steps run so far.

        Returns the full-batch loss (and the last stage's outputs if asked).

        Raises:
            ValueError: an empty batch, missing inputs/targets, targets whose batch size is not the
                inputs', a zero normalizer.
            NonFiniteError: a NaN/inf loss or gradient under ``nonfinite="raise"``.
            Exception: whatever a layer raised, with its stage and micro-batch in the message.
        """
        if step is not None:
            self.step_count = step
        try:
            M = self._num_microbatches(inputs, targets)
            plan = StepPlan(self.step_count, M, checkpointed_microbatches(self.options.checkpoint, M),
                            loss_fn=loss_fn)
            plan.loss_weights = self._loss_weights(inputs, targets, M, loss_normalizer)
            # inputs needing grad (a trainable front end of the caller's, say) get their gradient
            # by one backward of the caller's graph after the step's, as one plain backward would
            values = as_tuple(inputs, "inputs") if inputs is not None and 0 in self.runtimes else ()
            graph = any(t.requires_grad for t in values)
            feed = self._feed(inputs, targets, M, leaves=graph)
        except BaseException as exc:
            self.channel.fail_early(exc)
            raise
        with torch.enable_grad():
            loss, outputs = self._execute(feed, plan, "train", return_outputs)
            if graph:
                grads = input_gradients([t.device for t in values], feed.inputs)  # type: ignore[arg-type]
                pairs = [(t, g) for t, g in zip(values, grads) if t.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                self.executor.stage_flags.take()  # the caller's graph may reach stage parameters too
        total = self._judge(loss)
        if not self.last_step_skipped:
            self._commit_batch_norm()
        self.step_count += 1
        return (total, outputs) if return_outputs else total

    def forward_only(self, inputs: Value | None) -> Value | None:
        """The pipelined output without building a graph (on the rank holding the last stage).

        Raises:
            TypeError, ValueError: inputs that are not tensors or cannot be split.
            Exception: whatever a layer raised, with its stage and micro-batch in the message.
        """
        M = self._num_microbatches(inputs, None)
        plan = StepPlan(self.step_count, M, frozenset(), grad_enabled=False)
        with torch.no_grad():
            _, outputs = self._execute(self._feed(inputs, None, M), plan, "forward", True)
        self.step_count += 1  # every call is a step of its own: the next one draws fresh random numbers
        self._commit_batch_norm()  # a training-mode forward is one mini-batch, as for nn.BatchNorm
        return outputs

    # ------------------------------------------------------------ pipe(x): the step in two halves
    def forward_half(self, inputs: tuple[Tensor, ...], was_tensor: bool) -> HalfStep:
        """``pipe(x)``'s forward: fill-drain's forward half with graphs kept (or re-materialized
        later, per ``checkpoint``); deferred BatchNorm statistics are committed here, as
        ``nn.BatchNorm``'s move in the forward. Finish it with ``backward_half``.

        Raises:
            TypeError, ValueError: inputs that are not tensors or cannot be split.
            Exception: whatever a layer raised, with its stage and micro-batch in the message.
        """
        M = self._num_microbatches(inputs, None)
        plan = StepPlan(self.step_count, M, checkpointed_microbatches(self.options.checkpoint, M))
        # each micro-batch's input is a leaf of its own, so stage 0 hands back its gradient
        leaves = input_leaves(inputs, M, self.runtimes[0].device)
        with torch.enable_grad():
            _, outputs = self._execute(StepFeed(leaves, was_tensor), plan, "forward", keep_outputs=True)
        self._commit_batch_norm()
        self.step_count += 1  # counted at the forward: a call never back-propagated still draws fresh numbers
        last = self._last
        assert last is not None and outputs is not None  # a local pipeline holds its last stage
        sizes = [last.outputs[i][0][0].shape[0] for i in range(M)]
        return HalfStep(outputs, last.outputs[0][1], plan, leaves, sizes, self.generation)

    def backward_half(self, half: HalfStep, output_grads: Sequence[Values]) -> None:
        """The backward half of ``half`` from the gradient of each micro-batch's outputs: fills the
        parameters' gradients and the ``.grad`` of ``half.leaves``; then the non-finite policy, as
        after ``train_step``.

        Raises:
            RuntimeError: another step began after ``half``'s forward.
            NonFiniteError: a NaN/inf gradient under ``nonfinite="raise"``.
            Exception: whatever a layer raised, with its stage and micro-batch in the message.
        """
        if self.generation != half.generation:
            raise RuntimeError("the pipeline ran another step (pipe(x) or train_step) before this output's "
                               "backward; back-propagate each pipe(x) output before the next call")
        feed = StepFeed(None, False, output_grads=output_grads)
        self._execute(feed, half.plan, "backward", keep_outputs=False, fresh=False)
        self._judge(None, half.plan.step)

    # ------------------------------------------------------------ the end of a step, on every rank alike
    def _judge(self, loss: Tensor | None, step: int | None = None) -> Tensor:
        """Share the loss and the non-finite verdict over every rank, then apply the policy to all
        alike; returns the full-batch loss (zero when there is none). ``step`` names the step in
        the error (default: ``step_count``).

        Raises:
            NonFiniteError: a NaN/inf loss or gradient under ``nonfinite="raise"``.
        """
        device = next(iter(self.runtimes.values())).device if loss is None else loss.device
        check = self.options.nonfinite != "ignore"
        if not check and self.channel.holds_all_stages:  # nothing to judge, nothing to share: no read
            self.last_step_skipped = False
            return loss if loss is not None else torch.zeros((), device=device)
        modules = {j: r.step_walk().parameters for j, r in self.runtimes.items()}
        shared = self.channel.share(verdict_vector(loss, modules, self._num_virtual, self._dp_size, check,
                                                   device, self.executor.stage_flags.take()))
        values = read_verdict(shared)  # the step's one device-to-host read
        whole = self.channel.holds_all_stages and loss is not None
        self._apply_policy(describe_problem(values, self._num_ranks, self.options.virtual_stages,
                                            loss if whole else None), step)
        if whole:
            return loss  # type: ignore[return-value]
        return shared[0].to(loss_dtype(values))

    def _apply_policy(self, problem: str | None, step: int | None = None) -> None:
        """Raise, or skip the step (drop the gradients), on every rank alike."""
        self.last_step_skipped = False
        if problem is None:
            return
        self._reset_batch_norm()
        if self.options.nonfinite == "raise":
            raise NonFiniteError(f"step {self.step_count if step is None else step}: {problem} "
                                 "(set nonfinite='skip' to skip such steps)")
        for runtime in self.runtimes.values():
            runtime.module.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.last_step_skipped = True

    def _batch_norms(self) -> list[DeferredBatchNorm]:
        found = {id(m): m for r in self.runtimes.values() for m in r.step_walk().modules
                 if isinstance(m, DeferredBatchNorm)}
        return list(found.values())

    def _commit_batch_norm(self) -> None:
        for m in self._batch_norms():
            m.commit()

    def _reset_batch_norm(self) -> None:
        for m in self._batch_norms():
            m.reset_accumulators()

"""``pipe(x)``'s step in two halves: the public entries of ``PipelineCore`` that
``autograd_forward`` calls.

``forward_half`` runs fill-drain's forward half with graphs kept (or
re-materialized later, per ``checkpoint``) and returns a ``HalfStep``;
``backward_half`` runs the backward half from the caller's output gradients and
then ends the step as ``train_step`` does (the non-finite verdict). The step is
counted at the forward: a ``pipe(x)`` never back-propagated still draws fresh
random numbers on the next call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from gpipe_lab.pipeline.microbatch import Value
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.stage.stage_state import StepPlan
from gpipe_lab.pipeline.step.batching import checkpointed_microbatches, input_leaves
from gpipe_lab.pipeline.step.channel import StepFeed, Values


class HalfStep(NamedTuple):
    """A ``pipe(x)`` step whose forward half ran (``PipelineCore.forward_half``)."""

    outputs: Value
    output_was_tensor: bool
    plan: StepPlan
    leaves: list[tuple[Tensor, ...]]  # each micro-batch's inputs, as leaves on the first stage's device
    sizes: list[int]  # each micro-batch's output batch size
    generation: int


class HalfSteps:
    """Mixed into ``PipelineCore`` (which provides the step machinery used here)."""

    options: PipelineOptions
    runtimes: dict[int, StageRuntime]
    step_count: int
    generation: int
    _last: StageRuntime | None
    _num_microbatches: Callable[[object, object], int]
    _execute: Callable[..., tuple[Tensor | None, Value | None]]
    _commit_batch_norm: Callable[[], None]
    _judge: Callable[[Tensor | None, int | None], Tensor]

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

"""``pipe(x)`` as a differentiable module call, torchgpipe-style.

In training mode with gradients enabled, ``pipe(x)`` runs the forward half of the
fill-drain schedule with graphs kept (or re-materialized later, per ``checkpoint``)
and returns the joined output through ``_PipelineOutput``. Its backward hands each
micro-batch's output gradient to the last stage and runs the backward half of
fill-drain over the channel, so stages still back-propagate in parallel; the
parameters' gradients accumulate and the input gets its gradient. Deferred
BatchNorm statistics are committed at the end of the forward (a training-mode
forward is one mini-batch, as one ``nn.BatchNorm`` call on the whole batch).

Schedules that need the loss inside the pipeline (1F1B, zero-bubble, ...) cannot
run this way: their ``pipe(x)`` output refuses ``backward`` with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpipe_lab.pipeline.batching import checkpointed_microbatches
from gpipe_lab.pipeline.channel import StepFeed
from gpipe_lab.pipeline.core import PipelineCore
from gpipe_lab.pipeline.microbatch import Value, as_tuple, join, split, unwrap
from gpipe_lab.pipeline.schedules import FILL_DRAIN
from gpipe_lab.pipeline.stage import StepPlan


class _PipelineOutput(torch.autograd.Function):
    """Forward: the pipeline's forward half. Backward: its fill-drain backward half."""

    @staticmethod
    def forward(ctx: Any, core: PipelineCore, anchor: Tensor, was_tensor: bool,  # noqa: D102
                *inputs: Tensor) -> Any:
        M = core._num_microbatches(inputs, None)
        plan = StepPlan(core.step_count, M, checkpointed_microbatches(core.options.checkpoint, M))
        first = core.runtimes[0].device
        # each micro-batch's input is a leaf of its own, so stage 0 hands back its gradient
        micro = [tuple(t.detach().to(first).requires_grad_(t.requires_grad) for t in mb)
                 for mb in split(inputs, M, "inputs")]
        with torch.enable_grad():
            _, outputs = core._execute(StepFeed(micro, was_tensor), plan, "forward", keep_outputs=True)
        core._commit_batch_norm()  # running statistics move in the forward, as nn.BatchNorm's do
        core.step_count += 1  # counted at the forward: a call never back-propagated still draws fresh numbers
        ctx.core, ctx.plan, ctx.micro, ctx.generation = core, plan, micro, core.generation
        ctx.devices = [t.device for t in inputs]
        parts = [core.runtimes[len(core.runtimes) - 1].outputs[i][0] for i in range(M)]
        ctx.sizes = [p[0].shape[0] for p in parts]
        result = as_tuple(outputs, "pipeline output")
        return result[0] if len(result) == 1 else result

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:  # noqa: D102
        core, plan, micro = ctx.core, ctx.plan, ctx.micro
        if core is None:
            raise RuntimeError("the backward of a pipe(x) output can run once (retain_graph is not supported)")
        if core.generation != ctx.generation:
            raise RuntimeError("the pipeline ran another step (pipe(x) or train_step) before this output's "
                               "backward; back-propagate each pipe(x) output before the next call")
        per_output = [None if g is None else torch.split(g, ctx.sizes) for g in grads]
        output_grads = [tuple(None if g is None else g[i] for g in per_output)
                        for i in range(plan.num_microbatches)]
        feed = StepFeed(None, False, output_grads=output_grads)
        core._execute(feed, plan, "backward", keep_outputs=False, fresh=False)
        input_grads = []
        for j, device in enumerate(ctx.devices):
            pieces = [mb[j].grad for mb in micro]
            if any(p is None for p in pieces):
                input_grads.append(None)
            else:
                input_grads.append(join([(p,) for p in pieces])[0].to(device))
        ctx.core = ctx.micro = None
        return (None, None, None, *input_grads)


class _RefuseBackward(torch.autograd.Function):
    """An output that says why it cannot be back-propagated."""

    @staticmethod
    def forward(ctx: Any, message: str, anchor: Tensor, *outputs: Tensor) -> Any:  # noqa: D102
        ctx.message = message
        result = tuple(t.clone() for t in outputs)
        return result[0] if len(result) == 1 else result

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:  # noqa: D102
        raise RuntimeError(ctx.message)


def wants_graph(core: PipelineCore, inputs: tuple[Tensor, ...] = ()) -> bool:
    """Whether ``pipe(x)`` should be differentiable: gradients on, not inference mode, the
    pipeline and its layers in training mode (a framework may put only the layers in eval),
    and something (an input or a parameter) requiring grad."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or not core.training:
        return False
    modules = [r.module for r in core.runtimes.values()]
    if not any(layer.training for m in modules for layer in m.children()):
        return False
    return any(t.requires_grad for t in inputs) or any(p.requires_grad for m in modules for p in m.parameters())


def refuse_backward(outputs: Value, message: str) -> Value:
    """``outputs`` (values unchanged) whose backward raises ``RuntimeError(message)``."""
    values = as_tuple(outputs, "pipeline output")
    anchor = torch.zeros((), requires_grad=True)
    result = _RefuseBackward.apply(message, anchor, *values)
    return result if isinstance(outputs, Tensor) else as_tuple(result, "pipeline output")


def pipeline_forward(core: PipelineCore, inputs: Value) -> Value:
    """``pipe(x)``: differentiable in training mode with gradients on, forward-only otherwise.

    Raises:
        TypeError, ValueError: inputs that are not tensors or cannot be split.
    """
    values = as_tuple(inputs, "inputs")
    if not wants_graph(core, values):
        outputs = core._forward_only(inputs)
        assert outputs is not None
        return outputs
    if core.options.schedule not in FILL_DRAIN:
        outputs = core._forward_only(inputs)
        assert outputs is not None
        return refuse_backward(outputs, (
            f"schedule {core.options.schedule!r} needs the loss inside the pipeline, so pipe(x).backward() "
            f"cannot run it; use pipe.train_step(x, y, loss_fn), or schedule='gpipe' for pipe(x).backward()"))
    anchor = torch.zeros((), requires_grad=True)  # puts the call in the graph even if x needs no grad
    out = _PipelineOutput.apply(core, anchor, isinstance(inputs, Tensor), *values)
    parts = out if isinstance(out, tuple) else (out,)
    was_tensor = core.runtimes[len(core.runtimes) - 1].outputs[0][1]
    return unwrap(tuple(parts), was_tensor)


__all__ = ["pipeline_forward", "refuse_backward", "wants_graph"]

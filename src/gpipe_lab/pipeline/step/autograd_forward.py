"""``pipe(x)`` as a differentiable module call, torchgpipe-style.

In training mode with gradients enabled, ``pipe(x)`` runs the core's public
``forward_half`` (fill-drain's forward half, graphs kept or re-materialized later
per ``checkpoint``) and returns the joined output through ``_PipelineOutput``. Its
backward hands each micro-batch's output gradient to ``backward_half``, which runs
fill-drain's backward half through the executor, so stages still back-propagate in
parallel, each on its own thread; the parameters' gradients accumulate, the input
gets its gradient, and the non-finite policy applies as after ``train_step``.
Deferred BatchNorm statistics are committed at the end of the forward (a
training-mode forward is one mini-batch, as one ``nn.BatchNorm`` call on the whole batch).

Schedules that need the loss inside the pipeline (1F1B, zero-bubble, ...) cannot
run this way: their ``pipe(x)`` output refuses ``backward`` with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpipe_lab.pipeline.microbatch import Value, as_tuple, unwrap
from gpipe_lab.pipeline.schedules import FILL_DRAIN
from gpipe_lab.pipeline.step.batching import input_gradients
from gpipe_lab.pipeline.step.core import PipelineCore


class _PipelineOutput(torch.autograd.Function):
    """Forward: the core's ``forward_half``. Backward: its ``backward_half``."""

    @staticmethod
    def forward(ctx: Any, core: PipelineCore, shape: list[bool], anchor: Tensor,  # noqa: D102
                was_tensor: bool, *inputs: Tensor) -> Any:
        half = core.forward_half(inputs, was_tensor)
        shape.append(half.output_was_tensor)  # how to unwrap the outputs, for the caller
        ctx.core, ctx.half = core, half
        ctx.devices = [t.device for t in inputs]
        result = as_tuple(half.outputs, "pipeline output")
        return result[0] if len(result) == 1 else result

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:  # noqa: D102
        # Runs on the autograd engine's thread for the output's device (for CUDA, its device
        # worker); the stage threads back-propagate on their own threads (``executor``).
        core, half = ctx.core, ctx.half
        if half is None:
            raise RuntimeError("the backward of a pipe(x) output can run once (retain_graph is not supported)")
        ctx.half = None
        per_output = [None if g is None else torch.split(g, half.sizes) for g in grads]
        output_grads = [tuple(None if g is None else g[i] for g in per_output)
                        for i in range(half.plan.num_microbatches)]
        core.backward_half(half, output_grads)
        return (None, None, None, None, *input_gradients(ctx.devices, half.leaves))


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
        outputs = core.forward_only(inputs)
        assert outputs is not None
        return outputs
    if core.options.schedule not in FILL_DRAIN:
        outputs = core.forward_only(inputs)
        assert outputs is not None
        return refuse_backward(outputs, (
            f"schedule {core.options.schedule!r} needs the loss inside the pipeline, so pipe(x).backward() "
            f"cannot run it; use pipe.train_step(x, y, loss_fn), or schedule='gpipe' for pipe(x).backward()"))
    anchor = torch.zeros((), requires_grad=True)  # puts the call in the graph even if x needs no grad
    shape: list[bool] = []
    out = _PipelineOutput.apply(core, shape, anchor, isinstance(inputs, Tensor), *values)
    parts = out if isinstance(out, tuple) else (out,)
    return unwrap(tuple(parts), shape[0])


__all__ = ["pipeline_forward", "refuse_backward", "wants_graph"]

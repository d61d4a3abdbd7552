"""A stage's backward call: ``torch.autograd.backward`` less its per-call Python argument handling.

Every B action of every stage calls the autograd engine once. ``torch.autograd.backward``
first normalizes its arguments in Python (tuples, ``__torch_function__`` dispatch,
``_make_grads``' shape checks, which walk each shape symbolically): on layers whose kernels
take microseconds that is a large share of an action. The stage's call always has the same
form (outputs that require grad, their gradients from the next stage, or one scalar
loss), and the C++ engine validates each gradient against its output's shape, dtype and
device itself, so this goes straight to the engine's entry that ``torch.autograd.backward``
ends in (``torch.autograd.graph._engine_run_backward``, which keeps its TLS context and
debug-logging hooks). Anything else, and any torch without that entry, takes the public call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.overrides import has_torch_function

_engine_run_backward = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)


def stage_backward(tensors: Sequence[Tensor], grads: Sequence[Tensor] | None) -> None:
    """``torch.autograd.backward(tensors, grads)``: gradients accumulate into the leaves' ``.grad``.

    ``grads=None``: each tensor is a one-element output (a loss) whose gradient is one.

    Raises:
        RuntimeError: whatever the engine raises (a gradient of the wrong shape, a graph
            already freed, ...); as ``torch.autograd.backward`` for ``grads=None`` on a tensor
            of more than one element.
    """
    tensors = tuple(tensors)
    if _engine_run_backward is None or has_torch_function(tensors) or (
            grads is not None and has_torch_function(tuple(grads))):
        torch.autograd.backward(tensors, grads)
        return
    if grads is None:
        if any(t.numel() != 1 for t in tensors):
            torch.autograd.backward(tensors)  # raises torch's own error
            return
        grads = [torch.ones_like(t, memory_format=torch.preserve_format) for t in tensors]
    _engine_run_backward(tensors, tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)

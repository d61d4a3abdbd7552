"""W of ``nn.Linear`` layers without the autograd engine, batched over micro-batches.

A split backward (``weight_gradients``) leaves, per layer and micro-batch, the
gradient ``g`` of the layer's output; the layer's graph node still holds its
input ``x``. For ``y = x W^T + b`` (``AddmmBackward0``; ``MmBackward0`` without
bias) the weight gradients are ``dW = g^T x`` and ``db = sum(g)``: the same
products autograd forms. Done here directly they save an engine call per layer
and the temporary gradient (``addmm_`` accumulates in place), and several
micro-batches are stacked into one GEMM whose inner dimension is the whole
batch instead of one micro-batch: a GEMM over more rows costs less per row
(``benchmarks/probes/weight_grad_batching.py`` measures it).

Under autocast (bf16 or fp16) the parameters reach the GEMM through a cast;
the product is then formed in the 16-bit dtype and cast to the parameter's, as
autograd does. Anything else (other node types, hooks on a parameter, mixed
dtypes outside autocast's pattern, ``alpha``/``beta`` != 1) is refused, and the
caller runs autograd's W instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.graph import Node

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def _leaf(node: Node | None) -> Tensor | None:
    return getattr(node, "variable", None)


def _through_cast(node: Node | None) -> tuple[Node | None, bool]:
    """Past the dtype cast autocast puts between a parameter and its use: (node, was cast)."""
    if node is not None and node.name() == "ToCopyBackward0":
        return node.next_functions[0][0], True
    return node, False


def _linear_parts(node: Node) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """``(x, weight, bias)`` of a Linear's graph node, or ``None`` if it is not one."""
    name = node.name()
    # attr-defined below: a node's saved values (``_saved_*``) are not in torch's ``Node`` stub
    if name == "AddmmBackward0":  # x @ W^T + b: edges (bias, x, W^T)
        if node._saved_alpha != 1 or node._saved_beta != 1:  # type: ignore[attr-defined]
            return None
        bias_node, weight_node = node.next_functions[0][0], node.next_functions[2][0]
        x = node._saved_mat1  # type: ignore[attr-defined]
    elif name == "MmBackward0":  # x @ W^T without bias: edges (x, W^T)
        bias_node, weight_node = None, node.next_functions[1][0]
        x = node._saved_self  # type: ignore[attr-defined]
    else:
        return None
    if weight_node is None or weight_node.name() != "TBackward0":
        return None
    weight_leaf, weight_cast = _through_cast(weight_node.next_functions[0][0])
    bias_leaf, bias_cast = _through_cast(bias_node)
    weight = _leaf(weight_leaf)
    if weight is None or (bias_node is not None and _leaf(bias_leaf) is None):
        return None
    if bias_node is not None and bias_cast != weight_cast:
        return None
    return x, weight, _leaf(bias_leaf)


def linear_weight_grads(nodes: Sequence[Node], grads: Sequence[Tensor], params: Sequence[Tensor]) -> bool:
    """Accumulate ``dW += g^T x`` and ``db += sum(g)`` over ``nodes`` (one layer, one node per micro-batch).

    Returns ``False``, doing nothing, unless every node is the same ``nn.Linear`` on
    2-D input, its parameters are exactly ``params``, none has a gradient hook, and
    inputs, gradients and weight share dtype and device.
    """
    parts = [part for n in nodes if (part := _linear_parts(n)) is not None]
    if not parts or len(parts) < len(nodes):
        return False
    _, weight, bias = parts[0]
    owned = [t for t in (weight, bias) if t is not None]
    if any(p[1] is not weight or p[2] is not bias for p in parts):
        return False
    if len(owned) != len(params) or {id(t) for t in owned} != {id(p) for p in params}:
        return False
    if any(t._post_accumulate_grad_hooks or t._backward_hooks for t in owned):
        return False
    xs = [p[0] for p in parts]
    low = xs[0].dtype  # the compute dtype: the weight's own, or autocast's 16-bit one
    if low != weight.dtype and low not in _AUTOCAST_DTYPES:
        return False
    for x, g in zip(xs, grads):
        if x.dim() != 2 or g.dim() != 2 or x.dtype != low or g.dtype != low \
                or x.device != weight.device or g.device != weight.device:
            return False
    with torch.no_grad():
        g = grads[0] if len(grads) == 1 else torch.cat(list(grads))
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        if low != weight.dtype:  # as autograd: the GEMM in 16 bits, then the cast to the weight's dtype
            dw = g.t().mm(x).to(weight.dtype)
            weight.grad = dw if weight.grad is None else weight.grad.add_(dw)
        elif weight.grad is None:
            weight.grad = g.t().mm(x)
        else:
            weight.grad.addmm_(g.t(), x)
        if bias is not None:
            db = g.sum(0).to(bias.dtype)
            if bias.grad is None:
                bias.grad = db
            else:
                bias.grad.add_(db)
    return True

"""Gradient clipping by the global 2-norm over every stage of the pipeline.

The same result as ``torch.nn.utils.clip_grad_norm_`` on the unpipelined
model: per (device, dtype) group the norms come from one ``torch._foreach_norm``
(computed in float32, no copy of any gradient; a sparse gradient's from its
coalesced values), their squares are summed, and
with ``group`` (the distributed transport's pipeline group) summed over the
ranks holding the other stages; every gradient (sparse ones too) is then scaled in place by
``min(1, max_norm / (norm + 1e-6))`` with one ``torch._foreach_mul_`` per group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from gpipe_lab.pipeline.step.nonfinite import dense_values

#: what ``_group_tensors_by_device_and_dtype`` returns for lists without ``None`` (torch types the entries Optional)
_Groups = dict[tuple[torch.device, torch.dtype], tuple[list[list[Tensor]], list[int]]]


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> Tensor:
    """Scale the gradients of ``parameters`` so that their global 2-norm is at most ``max_norm``.

    ``group``: the process group whose other ranks hold the rest of the model (every
    rank of it must call this); ``None``: every stage's parameters are given here.
    ``device``: where the norm is summed (default: the first gradient's; the CPU
    when this rank has none). Returns the global norm before clipping (float32).

    Raises:
        ValueError: ``max_norm`` is not a positive finite number.
    """
    if not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}")
    every = [p.grad for p in parameters if p.grad is not None]
    if device is None:
        device = every[0].device if every else torch.device("cpu")
    grads: list[Tensor | None] = [g for g in every if g.layout == torch.strided]
    sparse = [g for g in every if g.layout != torch.strided]  # e.g. nn.Embedding(sparse=True)'s
    groups = cast(_Groups, _group_tensors_by_device_and_dtype([grads])) if grads else {}
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for (_, _), ([tensors], _) in groups.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        squares = squares + torch.stack(norms).square().sum().to(device)
    for g in sparse:
        squares = squares + torch.linalg.vector_norm(dense_values(g), dtype=torch.float32).square().to(device)
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for (grad_device, _), ([tensors], _) in groups.items():
        torch._foreach_mul_(tensors, coef.to(grad_device))
    for g in sparse:
        g.mul_(coef.to(g.device))
    return total

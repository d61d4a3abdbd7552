"""Inverted dropout with a named generator, in as few full-size passes as the device allows.

On CUDA, ``torch._fused_dropout`` draws the mask and scales in one kernel and takes a
generator (``native_dropout``, the kernel behind ``F.dropout``, only reads the default one);
its backward saves the one-byte mask. Elsewhere the mask is drawn straight into a bool
tensor (the same numbers as ``bernoulli_`` on a float tensor: one draw per element) and
applied by ``where``, whose backward saves only that bool mask, then scaled in place.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fused_dropout"]


def fused_dropout(x: Tensor, p: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """``(x`` with each element zeroed with probability ``p`` and the rest scaled by ``1/(1-p)``,
    the bool keep mask``)``; the mask is drawn from ``generator`` (the default one if ``None``).

    ``p`` must be in ``[0, 1)`` (callers check it).
    """
    if x.is_cuda and x.numel() > 0:
        out, keep = torch._fused_dropout(x, 1.0 - p, generator)  # its p is the keep probability
        return out, keep.view(torch.bool)  # a 0/1 byte mask: the same bytes read as bool
    keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p, generator=generator)
    return torch.where(keep, x, x.new_zeros(())).mul_(1.0 / (1.0 - p)), keep

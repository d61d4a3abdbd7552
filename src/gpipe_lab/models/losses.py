"""Token-level translation loss: cross entropy over non-PAD targets, optional label smoothing.

Two reductions: ``"mean"`` averages over the non-PAD tokens of the given batch;
``"sum"`` adds them up, for an engine that divides each micro-batch's sum by the
whole mini-batch's token count (``count_tokens``), so the pipelined loss equals
the full-batch token mean exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from gpipe_lab.models.transformer_layers import PAD

__all__ = ["token_cross_entropy", "translation_loss", "count_tokens"]


def token_cross_entropy(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0,
                        reduction: str = "mean") -> Tensor:
    """Cross entropy of ``logits [B,T,V]`` against ``targets [B,T]``, ignoring PAD (0).

    ``"mean"`` of a batch with no token is 0, not NaN. Raises ``ValueError`` for an
    unknown ``reduction`` or mismatched shapes.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                            ignore_index=PAD, label_smoothing=label_smoothing, reduction="sum")
    if reduction == "sum":
        return total
    return total / count_tokens(targets).clamp(min=1)


def count_tokens(targets: Tensor) -> Tensor:
    """Number of non-PAD tokens in ``targets``."""
    return (targets != PAD).sum()


def translation_loss(label_smoothing: float = 0.0, reduction: str = "mean") -> Callable[[Tensor, Tensor], Tensor]:
    """``loss_fn(logits, targets)`` for ``GPipe.train_step`` (see ``token_cross_entropy``).

    Raises ``ValueError`` for an unknown reduction or a smoothing outside [0, 1).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return token_cross_entropy(logits, targets, label_smoothing, reduction)

    return loss_fn

"""Dropout that draws from the running stage's generator.

The CPU has a single default generator shared by all threads, so ``nn.Dropout``
in two worker threads would draw in timing-dependent order. ``StageDropout``
draws from the generator of the (step, stage, micro-batch) being computed, so
the masks are the same on every run and identical when a checkpointed
micro-batch is recomputed. Inside a stage every other random op is routed to
the same generators (``random_replay``); ``StageDropout`` names it explicitly,
so it also works in code that runs a stage's layers outside that mode.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.context import current_generator


def keep_mask(x: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """A bool mask, True with probability ``1 - p``, drawn element for element as
    ``bernoulli_(1 - p)`` on a tensor like ``x`` would draw (same generator use)."""
    return torch.empty_like(x).bernoulli_(1.0 - p, generator=generator).bool()


def masked_scale(x: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """Inverted dropout of ``x`` whose autograd graph saves only a bool mask.

    ``x * keep`` with a float mask saves the mask in ``x``'s dtype (4 bytes an
    element in float32); ``where`` saves its bool condition (1 byte), and the
    scaling by a Python number saves nothing.
    """
    keep = keep_mask(x, p, generator)
    return torch.where(keep, x, x.new_zeros(())) * (1.0 / (1.0 - p))


class StageDropout(nn.Module):
    """Inverted dropout with masks from the stage generator (global RNG outside a pipeline)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return masked_scale(x, self.p, current_generator())

    def extra_repr(self) -> str:
        return f"p={self.p}"


def convert_dropout(module: nn.Module) -> int:
    """Replace every ``nn.Dropout`` inside ``module`` by a ``StageDropout``, in place.

    Returns the number of replaced modules.
    """
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Dropout:  # the others are replayed by random_replay as they are
            setattr(module, name, StageDropout(child.p))
            replaced += 1
        else:
            replaced += convert_dropout(child)
    return replaced

"""Dropout that draws from the running stage's generator.

The CPU has a single default generator shared by all threads, so ``nn.Dropout``
in two worker threads would draw in timing-dependent order. ``StageDropout``
draws from the generator of the (step, stage, micro-batch) being computed, so
the masks are the same on every run and identical when a checkpointed
micro-batch is recomputed. Where a stage owns its device's generator, that
generator, reseeded per micro-batch, is the running one; elsewhere it is a
generator of the micro-batch's own (``replay_policy``). ``StageDropout`` names it
explicitly, so it needs no per-op replay mode and works in compiled stages too.
"""

from __future__ import annotations

from torch import Tensor, nn

from gpipe_lab.pipeline.stage.context import current_generator, current_watch
from gpipe_lab.pipeline.stage.random_replay import fused_dropout


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
        generator, watch = current_generator(), current_watch()
        if watch is None:
            return fused_dropout(x, self.p, generator)[0]
        watch.before(generator)  # a probe tells this draw from the forward's other draws
        out = fused_dropout(x, self.p, generator)[0]
        watch.after(generator)
        return out

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

"""Each stage's non-finite gradient flag, taken by the stage's own worker as soon as it is final.

The verdict (``nonfinite``) judges every stage's gradients after a step. A stage's gradients
are final once its last backward action of the step has run (the last ``B``, or the last
``W`` in a split-backward schedule) and, under data parallelism, once their all-reduce has
ended. The executor then calls ``stage_final`` on that stage's thread, which launches the
stage's read-only check (``nonfinite.gradient_flag``) there and keeps the flag: the check of
stage s runs while stages before it still back-propagate, instead of after the drain. The
core's verdict takes the flags kept here (``take``) and checks only the stages without one
(a stage whose data-parallel all-reduce ends in the endpoint's ``close``). Nothing is read
on the host here: the verdict stays the step's one read.
"""

from __future__ import annotations

from torch import Tensor

from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.nonfinite import gradient_flag


class StageFlags:
    """The flags of one step's stages (see the module docstring); armed per step by the core."""

    def __init__(self) -> None:
        self.enabled = False
        self.flags: dict[int, Tensor | None] = {}

    def arm(self, enabled: bool) -> None:
        """Before running a schedule: keep flags this time (``enabled``) or none."""
        self.enabled = enabled
        self.flags = {}

    def stage_final(self, runtime: StageRuntime) -> None:
        """``runtime``'s gradients are final for this step: launch its check (on the calling thread)."""
        if self.enabled:
            self.flags[runtime.index] = gradient_flag(p.grad for p in runtime.step_walk().parameters)

    def take(self) -> dict[int, Tensor | None]:
        """The flags kept since ``arm``, per stage (``None``: no gradient); forgets them."""
        flags, self.flags, self.enabled = self.flags, {}, False
        return flags

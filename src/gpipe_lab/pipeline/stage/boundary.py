"""Stage boundary signatures: a stage's outputs must keep their form from step to step.

What crosses a stage boundary is a tuple of tensors; its *signature* is, per value,
its dtype, its number of dimensions and its shape beyond the batch dimension (``None``
entries as such), and so the number of values. The batch size is not part of it: it may
change every step (a smaller last batch, ``min(chunks, batch)`` micro-batches).

Each stage records, once per step (at the forward of micro-batch 0, which every forward
schedule runs), the signature of what it sends to the next stage together with the
conditions that produced it: the signature of its own inputs, the layers' training
modes, grad mode and autocast. On a later step under the same conditions the outputs
must have the same signature, else ``BoundaryChangedError`` names both stages and both
signatures (without it, the next stage's first layer would fail with an error of its
own, or a distributed receiver would get buffers of another form). When the conditions
change (a new sequence length in the inputs, ``eval()``, autocast on or off) the new
signature is recorded without complaint: the unpipelined model would change alike.

The check runs in ``channel.run_action`` on the sending stage, so it is the same on
both transports; its cost is one tuple comparison per stage and step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from gpipe_lab.pipeline.stage.checkpointing import autocast_state

#: per value: ``None``, or (dtype, number of dimensions, shape beyond the batch dimension)
Signature = tuple["tuple[torch.dtype, int, tuple[int, ...]] | None", ...]


class BoundaryChangedError(ValueError):
    """A stage's outputs changed dtype, shape beyond the batch dimension or number between steps
    run under the same conditions (same inputs' signature, layer modes, grad mode, autocast)."""


def signature(values: Sequence[Tensor | None]) -> Signature:
    """The boundary signature of ``values`` (see the module docstring)."""
    return tuple(None if t is None else (t.dtype, t.dim(), tuple(t.shape[1:])) for t in values)


def show(sig: Signature) -> str:
    """A signature as text, the batch dimension as ``*``: ``(float32[*, 16], None)``."""
    def one(entry: tuple[torch.dtype, int, tuple[int, ...]] | None) -> str:
        if entry is None:
            return "None"
        dtype, ndim, rest = entry
        dims = ", ".join(["*"] * min(ndim, 1) + [str(d) for d in rest])
        return f"{str(dtype).removeprefix('torch.')}[{dims}]"

    return "(" + ", ".join(one(e) for e in sig) + ")"


class BoundaryRecord:
    """What stage ``stage`` last sent to stage ``stage + 1``, and under which conditions."""

    __slots__ = ("stage", "conditions", "sent")

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.conditions: Hashable = None
        self.sent: Signature | None = None

    def check(self, inputs: Sequence[Tensor | None], outputs: Sequence[Tensor | None],
              modes: tuple[bool, ...]) -> None:
        """Compare ``outputs`` with what was sent on earlier steps under the same conditions
        (``inputs``: the stage's inputs; ``modes``: its layers' training flags), then record them.

        Raises:
            BoundaryChangedError: same conditions, another signature; naming both stages and both
                signatures.
        """
        sent = signature(outputs)
        conditions = (signature(inputs), modes, torch.is_grad_enabled(), autocast_state())
        if sent != self.sent and conditions == self.conditions:
            assert self.sent is not None  # conditions are recorded together with a signature
            raise BoundaryChangedError(
                f"stage {self.stage} now sends {show(sent)} to stage {self.stage + 1}, which received "
                f"{show(self.sent)} on earlier steps from the same inputs {show(conditions[0])}: a "
                "boundary value must keep its dtype, its shape beyond the batch dimension and the number "
                "of values from step to step")
        self.sent, self.conditions = sent, conditions

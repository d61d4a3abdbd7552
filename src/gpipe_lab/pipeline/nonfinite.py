"""The non-finite step policy: detect NaN/inf, agree on a verdict, describe it.

Every front door decides the same way. After a step each holder of stages builds
a verdict vector over its own stages; the channel sums the vectors over every
rank (locally: nothing to sum), so all ranks read the same verdict::

    slot 0       this replica's loss share (loss / D)
    slot 1       > 0 if some rank's loss is NaN/inf
    slot 2 + j   > 0 if (virtual) stage j's gradients are NaN/inf somewhere
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

NONFINITE_POLICIES = ("raise", "skip", "ignore")


class NonFiniteError(FloatingPointError):
    """The loss or a stage's gradients are NaN or infinite (policy ``nonfinite="raise"``)."""


def all_finite(tensors: Iterable[Tensor | None]) -> bool:
    """Whether every element of every tensor is finite (``None`` entries are skipped).

    Fast path: one sum per tensor (a single read, no tensor-sized temporary; NaN
    and inf survive a sum). A sum can also overflow on huge but finite values, so
    a non-finite sum is confirmed element-wise before ``False`` is returned.
    """
    present = [t for t in tensors if t is not None]
    if not present:
        return True
    # 16-bit sums are taken in float32 so that ordinary gradients do not overflow
    sums = torch.stack([t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum().float()
                        for t in present])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(t.isfinite().all()) for t in present)


def verdict_vector(loss: Tensor | None, modules: Mapping[int, nn.Module], num_chunks: int,
                   dp_size: int, check: bool, device: torch.device) -> Tensor:
    """This rank's contribution: its loss share and, with ``check``, its non-finite marks.

    ``modules`` maps each (virtual) stage held here to its layers.
    """
    shared = torch.zeros(2 + num_chunks, device=device)
    if loss is not None:
        shared[0] = loss.detach().float() / dp_size
    if not check:
        return shared
    if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
        shared[1] = 1.0
    for j, module in modules.items():
        if not all_finite(p.grad for p in module.parameters()):
            shared[2 + j] = 1.0
    return shared


def describe_problem(shared: Tensor, num_stages: int, virtual_stages: int,
                     loss: Tensor | None = None) -> str | None:
    """What the summed vector says went wrong, or ``None`` when the step is finite.

    ``loss`` (when this rank holds the whole loss) is quoted instead of slot 0.
    """
    def name(chunk: int) -> str:
        return str(chunk) if virtual_stages == 1 else f"{chunk % num_stages} (chunk {chunk})"

    if shared[1] > 0:
        value = shared[0].item() if loss is None else loss.item()
        return f"loss is {value} (computed on stage {name(num_stages * virtual_stages - 1)})"
    bad = [j for j in range(len(shared) - 2) if shared[2 + j] > 0]
    return f"gradients of stage {name(bad[0])} are not finite" if bad else None

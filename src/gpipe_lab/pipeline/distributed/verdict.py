"""The non-finite verdict every rank agrees on (``DistributedGPipe``'s ``nonfinite`` policy).

Layout of the vector all-reduced with the loss after each step:

    slot 0       this replica's loss share (loss / D)
    slot 1       > 0 if some rank's loss is NaN/inf
    slot 2 + j   > 0 if chunk j's gradients are NaN/inf somewhere

One all-reduce therefore shares the loss and the verdict, so all ranks act alike.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from gpipe_lab.pipeline.finite import all_finite
from gpipe_lab.pipeline.stage import StageRuntime


def verdict_vector(loss: Tensor | None, runtimes: Mapping[int, StageRuntime], num_chunks: int,
                   dp_size: int, check: bool, device: torch.device) -> Tensor:
    """This rank's contribution: its loss share and, with ``check``, its non-finite marks."""
    shared = torch.zeros(2 + num_chunks, device=device)
    if loss is not None:
        shared[0] = loss.detach().float() / dp_size
    if not check:
        return shared
    if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
        shared[1] = 1.0
    for j, runtime in runtimes.items():
        if not all_finite(p.grad for p in runtime.module.parameters()):
            shared[2 + j] = 1.0
    return shared


def describe_problem(shared: Tensor, num_stages: int, virtual_stages: int) -> str | None:
    """What the all-reduced vector says went wrong, or ``None`` when the step is finite."""
    def name(chunk: int) -> str:
        return str(chunk) if virtual_stages == 1 else f"{chunk % num_stages} (chunk {chunk})"

    if shared[1] > 0:
        return f"loss is {shared[0].item()} (computed on stage {name(num_stages * virtual_stages - 1)})"
    bad = [j for j in range(len(shared) - 2) if shared[2 + j] > 0]
    return f"gradients of stage {name(bad[0])} are not finite" if bad else None

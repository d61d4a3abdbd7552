"""Where a pipelined LightningModule's tensors live outside its pipelined layers."""

from __future__ import annotations

import torch
from torch import nn

from gpipe_lab.pipeline.partitioning.materialize import reset_module


def place_outside(root: nn.Module, inner: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers of ``root`` that ``inner`` does not hold to ``device``.

    ``inner``'s tensors stay where they are; parameters keep their identity. A module of
    ``root`` built on ``meta`` is allocated on ``device`` and reset (``reset_parameters``).

    Raises:
        ValueError: a module outside ``inner`` holds meta tensors and has no
            ``reset_parameters`` / ``reset_running_stats`` to initialize them.
    """
    inside = {id(t) for t in (*inner.parameters(), *inner.buffers())}
    for name, m in root.named_modules():
        own = [t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if id(t) not in inside]
        if any(t.is_meta for t in own):
            with torch.no_grad():
                m.to_empty(device=device, recurse=False)
                if not reset_module(m):
                    raise ValueError(f"module {name or type(root).__name__!r} ({type(m).__name__}) was built on "
                                     "the meta device outside the pipelined layers and has no reset_parameters() "
                                     "to initialize it: build it in __init__ (on the host), not in configure_model")
    for m in root.modules():
        for p in m.parameters(recurse=False):
            if id(p) not in inside and p.device != device:
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(device), p.requires_grad))
        for name, b in list(m.named_buffers(recurse=False)):
            if id(b) not in inside and b.device != device:
                setattr(m, name, b.to(device))

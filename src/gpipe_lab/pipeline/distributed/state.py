"""Checkpoints with one stage per process: the full state dict under the original names.

A chunk holding layers ``first..`` of the original ``nn.Sequential`` names its
entries ``"{i}.{rest}"`` with local ``i``; the original module names them
``"{first + i}.{rest}"``. ``gather_full_state_dict`` collects every chunk of
replica 0 on its first rank (global rank 0), which writes the checkpoint;
``local_state_dict`` picks one rank's keys back out of such a dict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def renamed(part: nn.Sequential, first: int) -> dict[str, torch.Tensor]:
    """A chunk's state dict with the original module's layer indices, on CPU."""
    out = {}
    for key, value in part.state_dict().items():
        i, _, rest = key.partition(".")
        out[f"{int(i) + first}.{rest}"] = value.detach().cpu()
    return out


def gather_full_state_dict(chunks: dict[int, tuple[int, nn.Sequential]], pp_group: object,
                           pp_ranks: list[int], dp_rank: int) -> dict[str, torch.Tensor] | None:
    """Collective over every rank: the full state dict on global rank 0, ``None`` elsewhere."""
    local: dict[str, torch.Tensor] = {}
    for first, part in chunks.values():
        local.update(renamed(part, first))
    if dp_rank != 0:
        return None
    if len(pp_ranks) == 1:
        return dict(sorted(local.items(), key=lambda kv: _order(kv[0])))
    gathered: list[object] | None = [None] * len(pp_ranks) if dist.get_rank() == pp_ranks[0] else None
    dist.gather_object(local, gathered, dst=pp_ranks[0], group=pp_group)
    if gathered is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)  # type: ignore[arg-type]
    return dict(sorted(full.items(), key=lambda kv: _order(kv[0])))


def _order(key: str) -> tuple[int, str]:
    i, _, rest = key.partition(".")
    return int(i), rest


def local_state_dict(full: dict[str, torch.Tensor], first: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The entries of layers ``first .. first+num_layers-1``, renamed to the chunk's local indices."""
    out = {}
    for key, value in full.items():
        i, _, rest = key.partition(".")
        if i.isdigit() and first <= int(i) < first + num_layers:
            out[f"{int(i) - first}.{rest}"] = value
    return out

"""Checkpoints with one stage per process: the full state dict under the original names.

A chunk holding layers ``first..`` of the original ``nn.Sequential`` names its
entries ``"{i}.{rest}"`` with local ``i``; the original module names them
``"{first + i}.{rest}"``. ``gather_full_state_dict`` collects every chunk of
replica 0 on its first rank (global rank 0), which writes the checkpoint;
``local_state_dict`` picks one rank's keys back out of such a dict.

``by_name`` and ``by_index`` translate between the layer indices the chunks use and the
original ``nn.Sequential``'s own layer names (``stem``, ``cell0``, ...), so a checkpoint
of this transport names its weights as the unpipelined module (and the local transport) does.
"""

from __future__ import annotations

from typing import cast

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


def gather_full_state_dict(chunks: dict[int, tuple[int, nn.Sequential]], pp_group: dist.ProcessGroup | None,
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
    for got in cast("list[dict[str, torch.Tensor]]", gathered):  # every rank's part filled in
        full.update(got)
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


def by_name(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """``"{i}.{rest}"`` keys renamed ``"{names[i]}.{rest}"``, in the same order."""
    out = {}
    for key, value in state.items():
        i, _, rest = key.partition(".")
        out[f"{names[int(i)]}.{rest}"] = value
    return out


def by_index(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """``by_name`` undone: ``"{names[i]}.{rest}"`` keys renamed ``"{i}.{rest}"``. A key whose head is
    no layer name but an index (a checkpoint written before layers kept their names) keeps it;
    any other key is left out."""
    index = {name: str(i) for i, name in enumerate(names)}
    out = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        if head in index:
            out[f"{index[head]}.{rest}"] = value
        elif head.isdigit() and int(head) < len(names):
            out[key] = value
    return out


def named_after(state: dict[str, torch.Tensor], layers: nn.Sequential, prefix: str = "") -> dict[str, torch.Tensor]:
    """``state`` with the ``{prefix}{i}.`` keys of a state dict that numbers the layers of ``layers``
    (a checkpoint of this transport written before it kept their names) renamed after them; any
    other state (named already, or not fitting ``layers``) is returned as it is."""
    names = list(layers._modules)
    inner = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    heads = {k.split(".", 1)[0] for k in inner}
    if not inner or not all(h.isdigit() and int(h) < len(names) for h in heads):
        return state
    return {**{k: v for k, v in state.items() if not k.startswith(prefix)},
            **{prefix + k: v for k, v in by_name(inner, names).items()}}

"""A sample batch for each preset: the input a model built by ``build`` takes (for measuring it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["example_input"]


def example_input(model: nn.Module, batch_size: int = 1, device: str | torch.device = "meta") -> Any:
    """A batch for ``model`` built by ``build``: images ``[B,3,H,W]``, ``(src, tgt_in)`` or tokens.

    Raises ``ValueError`` if the model has no ``spec`` (was not made by ``build``).
    """
    spec = getattr(model, "spec", None)
    if spec is None:
        raise ValueError("model has no .spec (not built by gpipe_lab.models.build); pass example_input")
    o = spec.options
    if spec.family == "amoebanet":
        return torch.randn(batch_size, 3, o["image_size"], o["image_size"], device=device)
    tokens = torch.randint(4, o["vocab_size"], (batch_size, o["seq_len"]), device=device)
    return tokens if o["layout"] == "decoder_only" else (tokens, tokens.clone())

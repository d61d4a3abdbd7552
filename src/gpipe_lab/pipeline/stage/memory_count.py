"""Saved-activation bytes per forward: counted once per forward signature, then reused.

Counting (``gpipe_lab.pipeline.measuring.saved_bytes``) runs two Python calls per tensor autograd saves (pack
and unpack): on a model of many small ops that is several percent of the step (the
AmoebaNet analogue on CPU: 8%). What a forward saves is set by what it is given, not by
the values: input shapes, dtypes and which need gradients, grad mode, training mode,
autocast, whether it is a checkpointed forward or its replay, which parameters need
gradients, and on the last stage the loss function and its target's shapes. So with
``track_memory=True`` a stage counts the first forward of each signature and charges
later forwards of that signature the same bytes; ``track_memory="every_step"`` counts
every forward (for models whose saved tensors depend on values: data-dependent routing
or masks of data-dependent size). Both give the same figures on every other model.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.stage.checkpointing import autocast_state

#: signatures kept per stage: a run whose shapes never repeat counts every forward, holding no more
MAX_SIGNATURES = 256


def describe(value: Any) -> Hashable:
    """What a forward's saving can depend on in ``value``: tensors by shape, dtype, device and
    whether they need gradients; containers by their items; anything else by its type."""
    if isinstance(value, Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(describe(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, describe(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def parameters_needing_grad(parameters: Iterable[nn.Parameter]) -> Hashable:
    """Which parameters need gradients (a frozen layer saves less): one flag per parameter."""
    return tuple(p.requires_grad for p in parameters)


def _callable_name(fn: object) -> Hashable:
    """A loss function by its name (a new lambda per step is still the same loss)."""
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", type(fn).__qualname__))


class SignatureMemo:
    """Bytes saved per forward signature, for one stage."""

    def __init__(self) -> None:
        self._bytes: dict[Hashable, int] = {}

    def signature(self, module: nn.Module, params_key: Hashable, inputs: tuple[Tensor, ...], recomputing: bool,
                  checkpointed: bool, loss: tuple[object, object] | None) -> Hashable:
        """The forward's signature; ``loss`` is (loss_fn, target) on a last stage that computes it."""
        tail = None if loss is None else (_callable_name(loss[0]), describe(loss[1]))
        return (describe(inputs), recomputing, checkpointed, torch.is_grad_enabled(), module.training,
                autocast_state(), params_key, tail)

    def known(self, signature: Hashable) -> int | None:
        """The bytes a forward of ``signature`` saved, if one was counted."""
        return self._bytes.get(signature)

    def remember(self, signature: Hashable, saved_bytes: int) -> None:
        """Keep what a counted forward of ``signature`` saved (up to ``MAX_SIGNATURES`` signatures)."""
        if len(self._bytes) < MAX_SIGNATURES:
            self._bytes[signature] = saved_bytes

"""Compiled stages: each stage's module through ``torch.compile`` (``PipelineOptions.compile``).

Dynamo does not trace under a user ``TorchDispatchMode``: a compiled module called
inside ``RandomReplay`` silently runs eagerly. So a compiled stage runs without the
per-op replay, and its random draws are replayable only when they come from the
micro-batch generator by name (``StageDropout``, which every ``nn.Dropout`` becomes).
The first forward of each compiled stage runs eagerly under ``DrawCheck``, which
raises ``UnreplayableRandomError`` naming the op for any other draw, before any
compiled code runs. Dynamo breaks the graph at ``StageDropout``'s draw (a
``torch.Generator`` argument), so the dropout runs eagerly between compiled pieces.

Re-materialization calls the same compiled module (its grad-enabled graph), and the
split-backward schedules work on it exactly, but the compiled backward is one
autograd node, so their deferred weight pass repeats the input-gradient work.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpipe_lab.pipeline.context import current_generator
from gpipe_lab.pipeline.random_replay import UnreplayableRandomError, _current_layer, _dropout_probability

__all__ = ["CompiledStage", "DrawCheck", "compile_kwargs"]

_SEEDED = torch.Tag.nondeterministic_seeded


def compile_kwargs(value: object, key: str = "compile") -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for a ``compile`` option; ``None``: do not compile.

    Raises:
        ValueError: ``value`` is not a bool or a mapping of ``torch.compile`` keywords
            (the message names ``key``, the value and the allowed keywords).
    """
    if value is False or value is None:
        return None
    if value is True:
        return {}
    allowed = [p for p in inspect.signature(torch.compile).parameters if p != "model"]
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: must be true, false or a dict of torch.compile keywords "
                         f"({', '.join(allowed)}), got {value!r}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ValueError(f"{key}: {unknown[0]!r} is not a torch.compile keyword; allowed: {', '.join(allowed)}")
    return dict(value)


class DrawCheck(TorchDispatchMode):
    """Raises for a random op that does not draw from the running micro-batch's generator."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _SEEDED in func.tags and _dropout_probability(func, args, kwargs) != 0.0:
            generator, given = current_generator(), kwargs.get("generator")
            # the dispatcher hands over a new Python wrapper of the same generator: compare its state
            if generator is None or given is None or given.initial_seed() != generator.initial_seed() \
                    or not torch.equal(given.get_state(), generator.get_state()):
                raise UnreplayableRandomError(
                    f"layer {_current_layer()} draws random numbers with {func}, which a compiled stage "
                    "cannot replay (only nn.Dropout / StageDropout draw from the micro-batch generator "
                    "there); use compile=false, or replace the draw by a StageDropout")
        return func(*args, **kwargs)


class CompiledStage:
    """Calls ``torch.compile(module, **kwargs)``; the first call runs eagerly under ``DrawCheck``.

    One per stage, called from that stage's thread only.
    """

    def __init__(self, module: nn.Module, kwargs: Mapping[str, Any]) -> None:
        self.module = module
        self.compiled = torch.compile(module, **dict(kwargs))
        self.checked = False

    def __call__(self, *args: Any) -> Any:
        if not self.checked:
            with DrawCheck():
                out = self.module(*args)
            self.checked = self.module.training  # an eval forward draws nothing: check a training one
            return out
        return self.compiled(*args)

"""Compiled stages: each stage's module through ``torch.compile`` (``PipelineOptions.compile``).

Dynamo does not trace under a user ``TorchDispatchMode``: a compiled module called
inside ``RandomReplay`` silently runs eagerly. So a compiled stage runs without the
per-op replay, and its random draws are replayable only when they come from the
micro-batch generator by name (``StageDropout``, which every ``nn.Dropout`` becomes).
The first forward of each compiled stage runs eagerly under ``DrawCheck``, which
raises ``UnreplayableRandomError`` naming the op for any other draw, before any
compiled code runs. Dynamo breaks the graph at ``StageDropout``'s draw (a
``torch.Generator`` argument), so the dropout runs eagerly between compiled pieces.

Re-materialization calls the same compiled module (its grad-enabled graph). The
split-backward schedules are refused with ``compile`` (``split_backward_error``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpipe_lab.pipeline.options import OptionError
from gpipe_lab.pipeline.stage.context import current_generator
from gpipe_lab.pipeline.stage.random_replay import (
    UnreplayableRandomError,
    _current_layer,
    _dropout_probability,
    generator_argument,
)

__all__ = ["CompiledStage", "DrawCheck", "split_backward_error"]

_SEEDED = torch.Tag.nondeterministic_seeded


class DrawCheck(TorchDispatchMode):
    """Raises for a random op that does not draw from the running micro-batch's generator."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _SEEDED in func.tags and _dropout_probability(func, args, kwargs) != 0.0:
            generator, given = current_generator(), generator_argument(func, args, kwargs)
            # the dispatcher hands over a new Python wrapper of the same generator: compare its state
            if generator is None or given is None or given.initial_seed() != generator.initial_seed() \
                    or not torch.equal(given.get_state(), generator.get_state()):
                raise UnreplayableRandomError(
                    f"layer {_current_layer()} draws random numbers with {func}, which a compiled stage "
                    "cannot replay (only nn.Dropout / StageDropout draw from the micro-batch generator "
                    "there); use compile=false, or replace the draw by a StageDropout")
        return func(*args, **kwargs)


def split_backward_error(schedule: str) -> OptionError:
    """The error for ``compile`` with a schedule that splits the backward into B and W.

    A compiled stage's backward is one autograd node: W could not skip B's work, and
    AOT autograd's donated buffers (freed by the compiled backward) forbid the
    ``retain_graph`` that B needs to leave the graph to W.
    """
    return OptionError(f"compile: schedule {schedule!r} splits the backward into B and W, which a compiled "
                       "stage cannot (its backward is one autograd node); use compile=false with it, or a "
                       "schedule without split backward (gpipe, 1f1b, interleaved-1f1b)")


def _own_frame(module: nn.Module) -> Any:
    """``module``'s call in a function with a code object of its own.

    Dynamo keeps its compiled graphs, and its recompile limit (8), per code object:
    compiling the stages themselves would share ``nn.Sequential.forward``'s among every
    stage of every pipeline, and past 8 entries (K stages × grad modes) stages would
    silently run eagerly.
    """
    def stage_forward(*args: Any) -> Any:
        return module(*args)

    stage_forward.__code__ = stage_forward.__code__.replace()
    return stage_forward


class CompiledStage:
    """Calls ``torch.compile(module, **kwargs)``; the first training call runs eagerly under ``DrawCheck``.

    One per stage, called from that stage's thread only, with the stage's current module
    (compiled again if a front end has replaced it, e.g. by an autocast wrapper).
    """

    def __init__(self, kwargs: Mapping[str, Any]) -> None:
        self.kwargs = dict(kwargs)
        self.module: nn.Module | None = None
        self.compiled: Any = None
        self.checked = False

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        if module is not self.module:
            self.module, self.compiled = module, torch.compile(_own_frame(module), **self.kwargs)
        if not self.checked:
            with DrawCheck():  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
                out = module(*args)
            self.checked = self.module.training  # an eval forward draws nothing: check a training one
            return out
        return self.compiled(*args)

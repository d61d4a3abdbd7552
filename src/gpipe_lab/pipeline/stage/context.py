"""Per-thread state of the stage that is running: its generator, recompute flag.

Each stage runs in its own worker thread (local transport) or process
(distributed transport). Layers that need to know about the pipeline (the
deterministic dropout, the deferred BatchNorm) read this state; outside a
pipeline it is empty and they behave like their ``torch.nn`` originals.
Inside ``microbatch_context`` the stage's draws come from the micro-batch's generators
(how: ``replay_policy``), so a re-materialized forward draws the same.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpipe_lab.pipeline.stage.random_replay import RandomReplay

_state = threading.local()
# the running context's frame, ``[generator, recomputing, watch, lazy]``: one attribute of the
# thread-local, read and set once per forward (a list: a lazy generator is stored into it when made)
_NO_FRAME = (None, False, None, None)

_MASK = (1 << 63) - 1


def microbatch_seed(base_seed: int, step: int, stage: int, microbatch: int) -> int:
    """A seed that depends only on (base seed, step, stage, micro-batch), never on timing."""
    seed = base_seed & _MASK
    for part in (step, stage, microbatch):
        seed = (seed * 6364136223846793005 + 1442695040888963407 + part) & _MASK
    return seed


def current_generator() -> torch.Generator | None:
    """The generator of the running micro-batch, or ``None`` outside a pipeline (made here, at its
    first use, for a context given ``lazy``)."""
    frame = getattr(_state, "frame", _NO_FRAME)
    generator, lazy = frame[0], frame[3]
    if generator is None and lazy is not None:  # (a frame with ``lazy`` is a context's list)
        generator = _state.frame[0] = torch.Generator(device=lazy[0]).manual_seed(lazy[1])
    return generator


def current_watch() -> Any:
    """The running probe's draw watch (``replay_policy.DrawWatch``), or ``None``: a layer that
    draws from ``current_generator()`` by name calls its ``before``/``after`` around the draw."""
    return getattr(_state, "frame", _NO_FRAME)[2]


def is_recomputing() -> bool:
    """True while a checkpointed micro-batch's forward is being replayed."""
    return bool(getattr(_state, "frame", _NO_FRAME)[1])


class microbatch_context:  # noqa: N801 - used like a function: ``with microbatch_context(gen):``
    """Run a stage's forward with its own generator (and the recompute flag).

    With a generator and ``replay``, every random op inside draws from it (see
    ``RandomReplay``, which raises ``UnreplayableRandomError`` for a draw it cannot
    repeat) and the context yields the mode (its ``draws`` count what was drawn);
    without ``replay`` only layers that read ``current_generator()`` do, and it yields None.
    ``watch`` is what ``current_watch()`` returns inside. ``lazy = (device, seed)`` without a
    generator: ``current_generator()`` makes it at its first use, so a forward that draws nothing
    makes none. (A class, not a generator context manager: it wraps every forward of every micro-batch.)
    """

    def __init__(self, generator: torch.Generator | None, recomputing: bool = False, replay: bool = True,
                 watch: Any = None, lazy: tuple[torch.device, int] | None = None) -> None:
        self.frame = [generator, recomputing, watch, lazy]
        self.mode = RandomReplay(generator) if generator is not None and replay else None

    def __enter__(self) -> RandomReplay | None:
        self.previous = getattr(_state, "frame", _NO_FRAME)
        _state.frame = self.frame
        if self.mode is not None:
            try:
                self.mode.__enter__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
            except BaseException:
                _state.frame = self.previous
                raise
        return self.mode

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if self.mode is not None:
                self.mode.__exit__(*exc_info)  # type: ignore[no-untyped-call]  # (as __enter__)
        finally:
            _state.frame = self.previous

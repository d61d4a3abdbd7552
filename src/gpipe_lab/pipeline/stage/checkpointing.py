"""Whether the running micro-batch is checkpointed: ``is_checkpointing()`` for layers.

A checkpointed micro-batch runs its forward twice: first without keeping
activations, then replayed in its backward. As in torchgpipe,
``(is_checkpointing(), is_recomputing())`` is ``(True, False)`` in the first
forward, ``(False, True)`` in the replay and ``(False, False)`` in the forward of
a micro-batch whose graph is kept (and in forwards without a graph). Per
thread: each stage sets it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

_state = threading.local()
_DEVICE_TYPES = ("cpu", "cuda")
AutocastState = tuple[tuple[tuple[str, bool, torch.dtype], ...], bool]


def is_checkpointing() -> bool:
    """True in the first forward of a checkpointed micro-batch (False in its replay: see
    ``is_recomputing``), as torchgpipe's ``is_checkpointing``."""
    return getattr(_state, "checkpointing", False)


class checkpointing:  # noqa: N801 - used like a function: ``with checkpointing(flag):``
    """Mark the enclosed forward as (not) checkpointed for ``is_checkpointing`` (a class, not a
    generator context manager: it wraps every forward)."""

    def __init__(self, flag: bool) -> None:
        self.flag = flag

    def __enter__(self) -> None:
        self.previous = getattr(_state, "checkpointing", False)
        _state.checkpointing = self.flag

    def __exit__(self, *exc_info: object) -> None:
        _state.checkpointing = self.previous


def autocast_state() -> AutocastState:
    """The calling thread's autocast state per device type (and its cache flag), as
    ``torch.utils.checkpoint`` saves it with a forward to replay it under the same."""
    regions = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES)
    return regions, torch.is_autocast_cache_enabled()


@contextmanager
def autocast_as(state: AutocastState | None) -> Iterator[None]:
    """Run the enclosed replay under ``state`` (from ``autocast_state``), whatever the caller's is:
    a forward under autocast replayed by a backward outside it computes in the forward's dtypes.
    ``None``: the caller's state, unchanged."""
    if state is None or state == autocast_state():
        yield
        return
    regions, cache = state
    with ExitStack() as stack:
        for device_type, enabled, dtype in regions:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield

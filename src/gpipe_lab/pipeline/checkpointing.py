"""Whether the running micro-batch is checkpointed: ``is_checkpointing()`` for layers.

A checkpointed micro-batch runs its forward twice: first without keeping
activations, then replayed in its backward (``is_recomputing()`` is true only in
the replay). ``is_checkpointing()`` is true in both, so a layer can tell such a
micro-batch from one whose graph is kept. Per thread: each stage sets it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_state = threading.local()


def is_checkpointing() -> bool:
    """True in the forward of a checkpointed micro-batch, and during its replay."""
    return getattr(_state, "checkpointing", False)


@contextmanager
def checkpointing(flag: bool) -> Iterator[None]:
    """Mark the enclosed forward as (not) checkpointed for ``is_checkpointing``."""
    previous = getattr(_state, "checkpointing", False)
    _state.checkpointing = flag
    try:
        yield
    finally:
        _state.checkpointing = previous

"""A schedule registered for one test only (``registered``), and the user schedule the tests register:
fill-drain over the V placement, a virtual-stage form with a placement of its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpipe_lab.pipeline.schedules import (
    SCHEDULES,
    VIRTUAL_FORMS,
    Schedule,
    catalog,
    placed_fill_drain,
    register_schedule,
    v_placement,
)


def v_fill_drain(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Every forward, then every backward, with rank r holding stages r and 2K-1-r (the README's example)."""
    return placed_fill_drain(v_placement(num_ranks, virtual_stages), num_microbatches)


@contextmanager
def registered(name: str, *args: Any, **kwargs: Any) -> Iterator[str]:
    """``register_schedule(name, *args, **kwargs)`` for the body of the ``with``; then gone again."""
    register_schedule(name, *args, **kwargs)
    try:
        yield name
    finally:
        SCHEDULES.pop(name, None)
        VIRTUAL_FORMS.pop(name, None)
        catalog._SHAPES.pop(name, None)

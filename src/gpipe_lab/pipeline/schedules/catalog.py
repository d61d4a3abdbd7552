"""Every built-in schedule, listed explicitly, and the lookup ``get_schedule(name, K, M, v)``.

``SCHEDULES`` maps a name to its one-stage-per-rank generator ``(K, M) -> lists``;
``VIRTUAL_FORMS`` the names that also run with v > 1 virtual stages per rank.
``register_schedule`` adds a user's schedule (one stage per rank).
"""

from __future__ import annotations

from collections.abc import Callable

from gpipe_lab.pipeline.schedules.actions import Schedule, ScheduleFn, check_sizes
from gpipe_lab.pipeline.schedules.fill_drain import gpipe_schedule, looped_gpipe_schedule
from gpipe_lab.pipeline.schedules.interleaved import interleaved_1f1b_schedule, interleaved_plain
from gpipe_lab.pipeline.schedules.one_f_one_b import one_f_one_b_schedule
from gpipe_lab.pipeline.schedules.zero_bubble import gpipe_batched_w_schedule, zb_h1_schedule, zb_h2_schedule

SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved-1f1b": interleaved_plain,
    "gpipe-bw": gpipe_batched_w_schedule,
    "zb-h1": zb_h1_schedule,
    "zb-h2": zb_h2_schedule,
}

VIRTUAL_FORMS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": looped_gpipe_schedule,
    "1f1b": interleaved_1f1b_schedule,
    "interleaved-1f1b": interleaved_1f1b_schedule,
}

#: schedules whose backward is the fill-drain order with no loss inside the pipeline:
#: the only ones ``pipe(x).backward()`` can run.
FILL_DRAIN = frozenset({"gpipe"})


def register_schedule(name: str, fn: ScheduleFn) -> None:
    """Make a schedule generator ``(K, M) -> lists`` selectable by name.

    Raises:
        ValueError: ``name`` is empty or not a string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a schedule name must be a non-empty string, got {name!r}")
    SCHEDULES[name] = fn


def get_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Each pipeline rank's action list for the named schedule (v virtual stages per rank).

    Raises:
        ValueError: unknown name (the message lists the known ones), sizes below 1,
            or a schedule without a virtual-stage form when v > 1.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; allowed: {sorted(SCHEDULES)}")
    check_sizes(num_stages, num_microbatches, virtual_stages)
    if virtual_stages == 1:
        return SCHEDULES[name](num_stages, num_microbatches)
    if name not in VIRTUAL_FORMS:
        raise ValueError(f"schedule {name!r} has no form with virtual_stages={virtual_stages}; "
                         f"allowed: {sorted(VIRTUAL_FORMS)}")
    return VIRTUAL_FORMS[name](num_stages, num_microbatches, virtual_stages)


def rank_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """``get_schedule`` under the name the distributed transport's callers use.

    Raises:
        ValueError: as ``get_schedule``.
    """
    return get_schedule(name, num_ranks, num_microbatches, virtual_stages)

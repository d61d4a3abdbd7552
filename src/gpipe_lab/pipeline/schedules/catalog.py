"""Every built-in schedule, listed explicitly, the lookup ``get_schedule(name, K, M, v)`` and
``register_schedule``, the one way to add a schedule (whole: its forms and its placement).

``SCHEDULES`` maps a name to its one-stage-per-rank generator ``(K, M) -> lists``;
``VIRTUAL_FORMS`` a name to its form with v > 1 virtual stages per rank ``(K, M, v) -> lists``;
``schedule_placement(name, K, v)`` gives the rank of each stage (``placement``). A name may
have either form or both (``zb-v`` and ``dualpipev`` have only the v = 2 one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpipe_lab.pipeline.schedules.actions import Schedule, ScheduleFn, check_sizes
from gpipe_lab.pipeline.schedules.fill_drain import gpipe_schedule, looped_gpipe_schedule
from gpipe_lab.pipeline.schedules.interleaved import interleaved_1f1b_schedule, interleaved_plain
from gpipe_lab.pipeline.schedules.one_f_one_b import one_f_one_b_schedule
from gpipe_lab.pipeline.schedules.placement import (
    PLACEMENTS,
    Placement,
    PlacementFn,
    looped_placement,
    v_placement,
)
from gpipe_lab.pipeline.schedules.v_shape import dualpipe_v_schedule, zb_v_schedule
from gpipe_lab.pipeline.schedules.walker import validate_schedule
from gpipe_lab.pipeline.schedules.zero_bubble import gpipe_batched_w_schedule, zb_h1_schedule, zb_h2_schedule

VirtualFn = Callable[[int, int, int], Schedule]  # (ranks K, micro-batches M, virtual stages v) -> lists

SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved-1f1b": interleaved_plain,
    "gpipe-bw": gpipe_batched_w_schedule,
    "zb-h1": zb_h1_schedule,
    "zb-h2": zb_h2_schedule,
}

VIRTUAL_FORMS: dict[str, VirtualFn] = {
    "gpipe": looped_gpipe_schedule,
    "1f1b": interleaved_1f1b_schedule,
    "interleaved-1f1b": interleaved_1f1b_schedule,
    "zb-v": zb_v_schedule,
    "dualpipev": dualpipe_v_schedule,
}


@dataclass(frozen=True)
class _Shape:
    """How a schedule lays its stages out: the placement, and the v its virtual form runs with."""

    placement: PlacementFn = looped_placement
    virtual_stages: tuple[int, ...] | None = None  # None: any v > 1


#: schedules other than looped ones with any v (the default shape)
_SHAPES: dict[str, _Shape] = {
    "zb-v": _Shape(v_placement, (2,)),
    "dualpipev": _Shape(v_placement, (2,)),
}

#: schedules whose backward is the fill-drain order with no loss inside the pipeline:
#: the only ones ``pipe(x).backward()`` can run.
FILL_DRAIN = frozenset({"gpipe"})

#: the (K, M) a registration checks each form on, by default
CHECK_SIZES: tuple[tuple[int, int], ...] = ((1, 2), (2, 4), (3, 6), (4, 8))


def schedule_names() -> list[str]:
    """Every selectable schedule name (either form), sorted."""
    return sorted(set(SCHEDULES) | set(VIRTUAL_FORMS))


def virtual_stage_counts(name: str) -> tuple[int, ...] | None:
    """The v > 1 the named schedule's virtual form runs with (None: any; () : none).

    Raises:
        ValueError: an unknown name (listing the known ones).
    """
    _known(name)
    if name not in VIRTUAL_FORMS:
        return ()
    return _SHAPES.get(name, _Shape()).virtual_stages


def schedule_placement(name: str, num_ranks: int, virtual_stages: int = 1) -> Placement:
    """The rank of each of the K·v stages under the named schedule (decided once, before any list).

    Raises:
        ValueError: an unknown name.
    """
    _known(name)
    return tuple(_SHAPES.get(name, _Shape()).placement(num_ranks, virtual_stages))


def register_schedule(name: str, fn: ScheduleFn | None = None, *, virtual_form: VirtualFn | None = None,
                      placement: str | PlacementFn = "looped", virtual_stages: Sequence[int] | None = None,
                      check_sizes_on: Sequence[tuple[int, int]] = CHECK_SIZES) -> None:
    """Make a schedule selectable by name everywhere a built-in one is: ``GPipe(schedule=...)``,
    ``DistributedGPipe``, the config key ``pipeline.schedule``, the simulator and ``plan=auto``.

    ``fn(K, M)`` gives one action list per rank with one stage per rank; ``virtual_form(K, M, v)``
    the lists with v virtual stages per rank (``virtual_stages``: the v it runs with, default
    any). ``placement`` is ``"looped"`` (stage s on rank s mod K), ``"v"`` (``v_placement``) or a
    function ``(K, v) -> rank of each stage``. Each form is checked now with ``validate_schedule``
    on every ``(K, M)`` of ``check_sizes_on`` (v = 2 for the virtual form, or its first allowed
    v); a size the generator refuses with ``ValueError`` is skipped, but one size must pass. A
    name registered again is replaced whole (forms and placement).

    Raises:
        ValueError: an empty name, no form, an unknown placement, or a form whose lists fail the
            check (the message names the schedule, K, M, v and the first bad action).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a schedule name must be a non-empty string, got {name!r}")
    if fn is None and virtual_form is None:
        raise ValueError(f"register_schedule({name!r}): give fn (one stage per rank), virtual_form, or both")
    if isinstance(placement, str):
        if placement not in PLACEMENTS:
            raise ValueError(f"register_schedule({name!r}): placement {placement!r} is not one of "
                             f"{sorted(PLACEMENTS)} nor a function (K, v) -> ranks")
        placement = PLACEMENTS[placement]
    counts = None if virtual_stages is None else tuple(virtual_stages)
    if counts is not None and (not counts or any(not isinstance(v, int) or v < 2 for v in counts)):
        raise ValueError(f"register_schedule({name!r}): virtual_stages must list integers >= 2, got {counts!r}")
    forms: list[tuple[int, Callable[[int, int], Schedule]]] = []
    if fn is not None:
        forms.append((1, fn))
    if virtual_form is not None:
        form, first = virtual_form, counts[0] if counts else 2
        forms.append((first, lambda K, M: form(K, M, first)))
    for v, make in forms:
        _check_form(name, make, v, placement, check_sizes_on)
    SCHEDULES.pop(name, None)
    VIRTUAL_FORMS.pop(name, None)
    if fn is not None:
        SCHEDULES[name] = fn
    if virtual_form is not None:
        VIRTUAL_FORMS[name] = virtual_form
    _SHAPES[name] = _Shape(placement, counts)


def _check_form(name: str, make: Callable[[int, int], Schedule], v: int, placement: PlacementFn,
                sizes: Sequence[tuple[int, int]]) -> None:
    """Validate one form on ``sizes`` (see ``register_schedule``)."""
    passed = 0
    for K, M in sizes:
        try:
            lists = make(K, M)
        except ValueError:
            continue  # the generator refuses this size itself, with its own message
        where = f"register_schedule({name!r}) with K={K}, M={M}, virtual_stages={v}"
        if not isinstance(lists, list) or len(lists) != K or not all(isinstance(a, list) for a in lists):
            raise ValueError(f"{where}: the generator must return a list of {K} action lists, "
                             f"got {type(lists).__name__}")
        try:
            validate_schedule(lists, M, v, placement(K, v))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        passed += 1
    if not passed:
        raise ValueError(f"register_schedule({name!r}): the generator refused every size checked "
                         f"{list(sizes)} (virtual_stages={v}); pass check_sizes_on=[(K, M), ...] it runs")


def _known(name: str) -> None:
    if name not in SCHEDULES and name not in VIRTUAL_FORMS:
        raise ValueError(f"unknown schedule {name!r}; allowed: {schedule_names()}")


def get_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Each pipeline rank's action list for the named schedule (v virtual stages per rank).

    Raises:
        ValueError: unknown name (the message lists the known ones), sizes below 1,
            or a schedule without a form for this v (the message lists the v it runs with).
    """
    _known(name)
    check_sizes(num_stages, num_microbatches, virtual_stages)
    if virtual_stages == 1 and name in SCHEDULES:
        return SCHEDULES[name](num_stages, num_microbatches)
    problem = form_problem(name, virtual_stages)
    if problem is not None:
        raise ValueError(problem)
    return VIRTUAL_FORMS[name](num_stages, num_microbatches, virtual_stages)


def form_problem(name: str, virtual_stages: int) -> str | None:
    """Why the named schedule cannot run with ``virtual_stages`` per rank (None: it can); the one
    rule ``get_schedule`` and ``PipelineOptions.check`` apply.

    Raises:
        ValueError: an unknown name.
    """
    _known(name)
    if virtual_stages == 1 and name in SCHEDULES:
        return None
    counts = virtual_stage_counts(name)
    if virtual_stages > 1 and name in VIRTUAL_FORMS and (counts is None or virtual_stages in counts):
        return None
    runs: list[int | str] = [1] if name in SCHEDULES else []
    if name in VIRTUAL_FORMS:
        runs += ["any >= 2"] if counts is None else list(counts)
    return f"schedule {name!r} has no form with virtual_stages={virtual_stages}; it runs with virtual_stages in {runs}"


def rank_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """``get_schedule`` under the name the distributed transport's callers use.

    Raises:
        ValueError: as ``get_schedule``.
    """
    return get_schedule(name, num_ranks, num_microbatches, virtual_stages)

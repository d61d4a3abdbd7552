"""Schedules as data: one file per family, an explicit registry, one walker.

``get_schedule(name, K, M, v=1)`` returns one ordered action list per pipeline
rank; both transports and the simulator follow the same lists, and read from them
which rank holds each stage (``placement``). ``register_schedule`` adds a schedule whole.
"""

from gpipe_lab.pipeline.schedules.actions import (
    Action,
    ActionKind,
    Schedule,
    ScheduleFn,
    check_sizes,
    weight_runs,
)
from gpipe_lab.pipeline.schedules.catalog import (
    FILL_DRAIN,
    SCHEDULES,
    VIRTUAL_FORMS,
    form_problem,
    get_schedule,
    rank_schedule,
    register_schedule,
    schedule_names,
    schedule_placement,
    virtual_stage_counts,
)
from gpipe_lab.pipeline.schedules.fill_drain import (
    analytic_bubble,
    gpipe_schedule,
    looped_gpipe_schedule,
    placed_fill_drain,
)
from gpipe_lab.pipeline.schedules.interleaved import interleaved_1f1b_schedule
from gpipe_lab.pipeline.schedules.one_f_one_b import one_f_one_b_schedule
from gpipe_lab.pipeline.schedules.placement import (
    Placement,
    looped_placement,
    placement_of,
    stages_on,
    v_placement,
)
from gpipe_lab.pipeline.schedules.v_shape import dualpipe_v_schedule, zb_v_schedule
from gpipe_lab.pipeline.schedules.walker import (
    MessageKey,
    dependency,
    dependent,
    expected_messages,
    incoming,
    outgoing,
    validate_rank_schedule,
    validate_schedule,
    walk,
)
from gpipe_lab.pipeline.schedules.zero_bubble import (
    gpipe_batched_w_schedule,
    greedy_split_schedule,
    zb_h1_schedule,
    zb_h2_schedule,
)

__all__ = [
    "FILL_DRAIN", "SCHEDULES", "VIRTUAL_FORMS", "Action", "ActionKind", "MessageKey", "Placement", "Schedule",
    "ScheduleFn", "analytic_bubble", "check_sizes", "dependency", "dependent", "dualpipe_v_schedule",
    "expected_messages", "form_problem", "get_schedule", "gpipe_batched_w_schedule", "gpipe_schedule", "greedy_split_schedule",
    "incoming", "interleaved_1f1b_schedule", "looped_gpipe_schedule", "looped_placement", "one_f_one_b_schedule",
    "outgoing", "placed_fill_drain", "placement_of", "rank_schedule", "register_schedule", "schedule_names",
    "schedule_placement", "stages_on", "v_placement", "validate_rank_schedule", "validate_schedule",
    "virtual_stage_counts", "walk", "weight_runs", "zb_h1_schedule", "zb_h2_schedule", "zb_v_schedule",
]

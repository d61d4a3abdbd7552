"""Schedules as data: one file per family, an explicit registry, one walker.

``get_schedule(name, K, M, v=1)`` returns one ordered action list per pipeline
rank; both transports and the simulator follow the same lists.
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
    get_schedule,
    rank_schedule,
    register_schedule,
)
from gpipe_lab.pipeline.schedules.fill_drain import analytic_bubble, gpipe_schedule, looped_gpipe_schedule
from gpipe_lab.pipeline.schedules.interleaved import interleaved_1f1b_schedule
from gpipe_lab.pipeline.schedules.one_f_one_b import one_f_one_b_schedule
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
    "FILL_DRAIN", "SCHEDULES", "VIRTUAL_FORMS", "Action", "ActionKind", "MessageKey", "Schedule", "ScheduleFn",
    "analytic_bubble", "check_sizes", "dependency", "dependent", "expected_messages", "get_schedule", "gpipe_batched_w_schedule",
    "gpipe_schedule", "greedy_split_schedule", "incoming", "interleaved_1f1b_schedule", "looped_gpipe_schedule",
    "one_f_one_b_schedule", "outgoing", "rank_schedule", "register_schedule", "validate_rank_schedule",
    "validate_schedule", "walk", "weight_runs", "zb_h1_schedule", "zb_h2_schedule",
]

"""Compatibility import path (a public name): the schedules live in ``gpipe_lab.pipeline.schedules``."""

from gpipe_lab.pipeline.schedules import (  # noqa: F401 - re-exported
    SCHEDULES,
    Action,
    ActionKind,
    Schedule,
    ScheduleFn,
    analytic_bubble,
    get_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
    register_schedule,
    validate_schedule,
    weight_runs,
)

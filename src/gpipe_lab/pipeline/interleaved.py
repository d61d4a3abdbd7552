"""Compatibility import path (a public name): the virtual-stage schedules live in ``gpipe_lab.pipeline.schedules``."""

from gpipe_lab.pipeline.schedules import (  # noqa: F401 - re-exported
    interleaved_1f1b_schedule,
    looped_gpipe_schedule,
    rank_schedule,
    validate_rank_schedule,
)

"""Planning before running: the schedule simulator (and the capacity model)."""

from gpipe_lab.planner.simulator import (
    Prediction,
    StageCosts,
    costs_from_timeline,
    durations_from_timeline,
    predict_step,
    simulate,
)

__all__ = ["Prediction", "StageCosts", "costs_from_timeline", "durations_from_timeline", "predict_step",
           "simulate"]

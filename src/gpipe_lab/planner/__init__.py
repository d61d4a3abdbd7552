"""Planning before running: the schedule simulator, the memory and capacity models, and the search.

The search (``planner.search``) reads as its steps: profile (``profile_cache``) → candidates
(``search.plans``) → memory filter (``memory``) → time prediction (``cost_model``) → rank (``rank``)
→ trials (``trials``). A plan is a ``Candidate`` holding the ``PipelineOptions`` that run it.
"""

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

"""The GPipe engine: pure PyTorch (+ torch.distributed); no Lightning, Hydra or wandb."""

from gpipe_lab.pipeline.devices.allocator import retain_freed_memory
from gpipe_lab.pipeline.errors import PipelineTimeoutError
from gpipe_lab.pipeline.gpipe import GPipe
from gpipe_lab.pipeline.measuring.step_timeline import Event, Timeline
from gpipe_lab.pipeline.options import CHECKPOINT_MODES, NONFINITE_POLICIES, OptionError, PipelineOptions
from gpipe_lab.pipeline.partitioning.materialize import seeded_init
from gpipe_lab.pipeline.partitioning.partition import balance_by_cost, layer_costs
from gpipe_lab.pipeline.partitioning.profiling import balance_by_size, balance_by_time
from gpipe_lab.pipeline.schedules import (
    SCHEDULES,
    Action,
    analytic_bubble,
    get_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
    register_schedule,
    schedule_names,
    validate_schedule,
)
from gpipe_lab.pipeline.skip import SkipError, isolate, pop, skippable, stash
from gpipe_lab.pipeline.stage.batchnorm import DeferredBatchNorm, commit_forward
from gpipe_lab.pipeline.stage.boundary import BoundaryChangedError
from gpipe_lab.pipeline.stage.checkpointing import is_checkpointing
from gpipe_lab.pipeline.stage.context import is_recomputing
from gpipe_lab.pipeline.stage.dropout import StageDropout, convert_dropout
from gpipe_lab.pipeline.stage.random_replay import UnreplayableRandomError
from gpipe_lab.pipeline.step.batching import checkpointed_microbatches
from gpipe_lab.pipeline.step.clipping import clip_grad_norm_
from gpipe_lab.pipeline.step.core import PipelineCore
from gpipe_lab.pipeline.step.nonfinite import NonFiniteError, all_finite

__all__ = [
    "CHECKPOINT_MODES", "NONFINITE_POLICIES", "NonFiniteError", "OptionError", "PipelineCore",
    "PipelineOptions", "SCHEDULES", "Action", "DeferredBatchNorm", "Event", "GPipe",
    "PipelineTimeoutError", "StageDropout", "Timeline", "UnreplayableRandomError", "analytic_bubble",
    "balance_by_cost", "balance_by_size", "balance_by_time", "checkpointed_microbatches", "commit_forward",
    "convert_dropout", "get_schedule", "gpipe_schedule", "is_checkpointing", "is_recomputing", "layer_costs",
    "one_f_one_b_schedule", "register_schedule", "schedule_names", "validate_schedule", "retain_freed_memory", "all_finite",
    "seeded_init", "clip_grad_norm_", "SkipError", "isolate", "pop", "skippable", "stash",
    "BoundaryChangedError",
]

"""1F1B: ``K-k-1`` warm-up forwards on stage ``k``, then one forward, one backward.

At most ``K - k`` micro-batches are alive on stage ``k`` (fill-drain keeps M).
"""

from __future__ import annotations

from gpipe_lab.pipeline.schedules.actions import Action, Schedule, check_sizes


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: ``K-k-1`` warm-up forwards, then alternate one forward, one backward.

    Raises:
        ValueError: fewer than 1 stage or micro-batch.
    """
    check_sizes(num_stages, num_microbatches)
    stages = []
    for k in range(num_stages):
        warmup = min(num_stages - k - 1, num_microbatches)
        actions = [Action(k, "F", i) for i in range(warmup)]
        next_forward, next_backward = warmup, 0
        while next_backward < num_microbatches:
            if next_forward < num_microbatches:
                actions.append(Action(k, "F", next_forward))
                next_forward += 1
            actions.append(Action(k, "B", next_backward))
            next_backward += 1
        stages.append(actions)
    return stages

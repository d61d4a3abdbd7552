"""Fill-drain (GPipe) schedules: every forward, then every backward in reverse order.

K=3, M=4; ``F3`` = forward of micro-batch 3, ``B3`` its backward; one column
per clock tick when all actions cost the same::

    stage 0 | F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    stage 1 | .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    stage 2 | .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

With v virtual stages per rank (looped fill-drain) each rank runs every forward
chunk by chunk, then the backwards with the chunks reversed.
"""

from __future__ import annotations

from gpipe_lab.pipeline.schedules.actions import Action, Schedule, check_sizes


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain: all forwards, then all backwards in reverse micro-batch order.

    Raises:
        ValueError: fewer than 1 stage or micro-batch.
    """
    check_sizes(num_stages, num_microbatches)
    return [
        [Action(k, "F", i) for i in range(num_microbatches)]
        + [Action(k, "B", i) for i in reversed(range(num_microbatches))]
        for k in range(num_stages)
    ]


def looped_gpipe_schedule(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Fill-drain over v chunks per rank: every forward chunk by chunk, then backwards reversed.

    Raises:
        ValueError: a size below 1.
    """
    check_sizes(num_ranks, num_microbatches, virtual_stages)
    K, M, v = num_ranks, num_microbatches, virtual_stages
    return [
        [Action(c * K + k, "F", mb) for c in range(v) for mb in range(M)]
        + [Action(c * K + k, "B", mb) for c in reversed(range(v)) for mb in reversed(range(M))]
        for k in range(K)
    ]


def analytic_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a fill-drain (or 1F1B) step: (K-1)/(v·M+K-1).

    Raises:
        ValueError: a size below 1.
    """
    check_sizes(num_stages, num_microbatches, virtual_stages)
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)

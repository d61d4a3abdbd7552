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

from collections.abc import Sequence

from gpipe_lab.pipeline.schedules.actions import Action, Schedule, check_sizes
from gpipe_lab.pipeline.schedules.placement import looped_placement, stages_on


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
    return placed_fill_drain(looped_placement(num_ranks, virtual_stages), num_microbatches)


def placed_fill_drain(placement: Sequence[int], num_microbatches: int) -> Schedule:
    """Fill-drain over any placement: each rank runs its stages' forwards in stage order, then
    their backwards in reverse (the halves ``pipe(x)`` and ``forward_only`` run)."""
    M = num_microbatches
    ranks = []
    for k in range(max(placement) + 1):
        mine = stages_on(placement, k)
        ranks.append([Action(s, "F", mb) for s in mine for mb in range(M)]
                     + [Action(s, "B", mb) for s in reversed(mine) for mb in reversed(range(M))])
    return ranks


def analytic_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a fill-drain (or 1F1B) step: (K-1)/(v·M+K-1).

    Raises:
        ValueError: a size below 1.
    """
    check_sizes(num_stages, num_microbatches, virtual_stages)
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)

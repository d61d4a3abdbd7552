"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v model chunks per pipeline rank.

The model is cut into ``S = K·v`` chunks; chunk ``s`` lives on rank ``s mod K``.
K=2, v=2, M=4; ``F2.3`` is the forward of micro-batch 2 on chunk 3::

    rank 0 | F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0
    rank 1 | F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1

Forwards go in groups of K micro-batches through chunk 0, then chunk 1, ...;
backwards mirror them with the chunks reversed. Rank ``k`` runs
``2(K-k-1) + (v-1)K`` warm-up forwards, then alternates. Its bubble is
(K-1)/(v·M+K-1).
"""

from __future__ import annotations

from gpipe_lab.pipeline.schedules.actions import Action, Schedule, check_sizes
from gpipe_lab.pipeline.schedules.one_f_one_b import one_f_one_b_schedule
from gpipe_lab.pipeline.schedules.walker import validate_schedule


def _grouped_order(num_ranks: int, num_microbatches: int, chunks: list[int]) -> list[tuple[int, int]]:
    """(local chunk, micro-batch) pairs: groups of K micro-batches through each chunk in turn."""
    order: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, num_ranks):
        group = range(first, min(first + num_ranks, num_microbatches))
        order.extend((c, mb) for c in chunks for mb in group)
    return order


def interleaved_1f1b_schedule(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B rank schedule; with ``virtual_stages == 1`` it is plain 1F1B.

    Raises:
        ValueError: non-positive sizes, or a micro-batch count that deadlocks this
            order (the message asks for a multiple of the number of ranks).
    """
    check_sizes(num_ranks, num_microbatches, virtual_stages)
    if virtual_stages == 1:
        return one_f_one_b_schedule(num_ranks, num_microbatches)
    K, v = num_ranks, virtual_stages
    chunks = list(range(v))
    forwards = _grouped_order(K, num_microbatches, chunks)
    backwards = _grouped_order(K, num_microbatches, chunks[::-1])
    total = len(forwards)
    ranks: Schedule = []
    for k in range(K):
        warmup = total if num_microbatches == K else min(total, 2 * (K - k - 1) + (v - 1) * K)
        actions = [Action(c * K + k, "F", mb) for c, mb in forwards[:warmup]]
        next_f, next_b = warmup, 0
        while next_b < total:
            if next_f < total:
                c, mb = forwards[next_f]
                actions.append(Action(c * K + k, "F", mb))
                next_f += 1
            c, mb = backwards[next_b]
            actions.append(Action(c * K + k, "B", mb))
            next_b += 1
        ranks.append(actions)
    try:
        validate_schedule(ranks, num_microbatches, v)
    except ValueError as exc:
        raise ValueError(f"interleaved 1F1B with K={K}, v={v} cannot run M={num_microbatches} "
                         f"micro-batches ({exc}); use a multiple of {K}") from None
    return ranks


def interleaved_plain(num_stages: int, num_microbatches: int) -> Schedule:
    """``interleaved-1f1b`` with one virtual stage per rank: the lists of 1F1B."""
    return interleaved_1f1b_schedule(num_stages, num_microbatches, 1)

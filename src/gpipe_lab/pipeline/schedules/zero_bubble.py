"""Split-backward schedules (Qi et al., ICLR'24, arXiv 2401.10241): ``zb-h1``, ``zb-h2``, ``gpipe-bw``.

The backward of a micro-batch is split in two actions: ``B`` computes only the
gradient of the stage input, so the previous stage can start its own ``B`` at
once; ``W`` computes the weight gradients later, in what would be a bubble
(see ``weight_gradients`` for how W avoids repeating B's work).

* ``zb-h1``: ``cap = min(K, M)`` in flight on every stage: the peak activation
  memory of 1F1B, and about 1/3 of its bubble when F = B = W.
* ``zb-h2``: ``cap = min(2K-1, M)`` from a list scheduler on unit clocks: close
  to zero bubble at about twice 1F1B's activation memory.
* ``gpipe-bw``: fill-drain whose weight gradients all come last, as one run.

K=3, M=4, zb-h1, as the simulator runs it with unit costs (``.`` = idle)::

    stage 0 | F0 F1 F2 .  .  B0 W0 F3 B1 W1 B2 W2 B3 W3
    stage 1 | .  F0 F1 .  B0 F2 B1 W0 F3 B2 W1 B3 W2 W3
    stage 2 | .  .  F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3
"""

from __future__ import annotations

from collections import deque

from gpipe_lab.pipeline.schedules.actions import Action, Schedule, check_sizes
from gpipe_lab.pipeline.schedules.walker import validate_schedule


def greedy_split_schedule(num_stages: int, num_microbatches: int, cap: int,
                          w_delay: list[int] | None = None) -> Schedule:
    """List-schedule F, B, W on unit clocks with at most ``cap`` micro-batches in flight per stage.

    At each tick a free stage k runs, by priority: its oldest ``W`` if more than
    ``w_delay[k]`` are pending; a ready ``B``; its next ``F`` if the input has
    arrived and fewer than ``cap`` micro-batches are in flight; its oldest ``W``.

    Raises:
        ValueError: fewer than 1 stage or micro-batch, or ``cap < 1``.
    """
    check_sizes(num_stages, num_microbatches)
    if cap < 1:
        raise ValueError(f"in-flight cap must be >= 1, got {cap}")
    K, M = num_stages, num_microbatches
    w_delay = list(w_delay) if w_delay is not None else [M] * K
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    next_f = [0] * K
    next_b = [0] * K
    pending_w: list[deque[int]] = [deque() for _ in range(K)]
    in_flight = [0] * K
    lists: Schedule = [[] for _ in range(K)]
    placed, tick = 0, 0
    while placed < 3 * K * M:
        for k in range(K):
            i = next_b[k]
            # the micro-batch's forward here is done, and its output gradient has arrived
            b_ready = i < next_f[k] and f_end[(k, i)] <= tick and (
                k == K - 1 or b_end.get((k + 1, i), tick + 1) <= tick)
            j = next_f[k]
            f_ready = j < M and in_flight[k] < cap and (k == 0 or f_end.get((k - 1, j), tick + 1) <= tick)
            if pending_w[k] and len(pending_w[k]) > w_delay[k]:
                lists[k].append(Action(k, "W", pending_w[k].popleft()))
                in_flight[k] -= 1
            elif b_ready:
                lists[k].append(Action(k, "B", i))
                b_end[(k, i)] = tick + 1
                next_b[k] += 1
                pending_w[k].append(i)
            elif f_ready:
                lists[k].append(Action(k, "F", j))
                f_end[(k, j)] = tick + 1
                next_f[k] += 1
                in_flight[k] += 1
            elif pending_w[k]:
                lists[k].append(Action(k, "W", pending_w[k].popleft()))
                in_flight[k] -= 1
            else:
                continue
            placed += 1
        tick += 1
    return lists


def zb_h1_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: split backward at 1F1B's peak memory (at most K micro-batches in flight per stage).

    Stage k runs ``K-k`` warm-up forwards, then for each micro-batch j: ``B j``,
    ``W j-k`` (its weight gradients delayed by k micro-batches, which lets the
    input gradients race down the pipeline), the next ``F``; then its last k ``W``.

    Raises:
        ValueError: fewer than 1 stage or micro-batch.
    """
    check_sizes(num_stages, num_microbatches)
    K, M = num_stages, num_microbatches
    schedule: Schedule = []
    for k in range(K):
        warmup = min(K - k, M)
        actions = [Action(k, "F", i) for i in range(warmup)]
        next_f = warmup
        for j in range(M):
            actions.append(Action(k, "B", j))
            if j >= k:
                actions.append(Action(k, "W", j - k))
            if next_f < M:
                actions.append(Action(k, "F", next_f))
                next_f += 1
        actions += [Action(k, "W", i) for i in range(max(M - k, 0), M)]
        schedule.append(actions)
    validate_schedule(schedule, M)
    return schedule


def zb_h2_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2: split backward with up to 2K-1 micro-batches in flight per stage (about 2x memory).

    Raises:
        ValueError: fewer than 1 stage or micro-batch.
    """
    check_sizes(num_stages, num_microbatches)
    schedule = greedy_split_schedule(num_stages, num_microbatches,
                                     min(2 * num_stages - 1, num_microbatches), list(range(num_stages)))
    validate_schedule(schedule, num_microbatches)
    return schedule


def gpipe_batched_w_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain with split backward: all F, all B (reverse order), then all W as one run.

    K=2, M=4, unit costs::

        stage 0 | F0 F1 F2 F3 .  .  B3 B2 B1 B0 W  W  W  W
        stage 1 | .  F0 F1 F2 F3 B3 B2 B1 B0 W  W  W  W  .

    Raises:
        ValueError: fewer than 1 stage or micro-batch.
    """
    check_sizes(num_stages, num_microbatches)
    M = num_microbatches
    schedule: Schedule = [
        [Action(k, "F", i) for i in range(M)] + [Action(k, "B", i) for i in reversed(range(M))]
        + [Action(k, "W", i) for i in reversed(range(M))]
        for k in range(num_stages)
    ]
    validate_schedule(schedule, M)
    return schedule

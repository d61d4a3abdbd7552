"""Schedules with v virtual stages (model chunks) per rank: interleaved 1F1B, looped fill-drain.

The model is cut into ``S = K·v`` chunks; chunk ``s`` lives on rank ``s mod K``,
so rank ``k`` holds chunks ``k, k+K, ..., k+(v-1)K``. A *rank schedule* is one
ordered action list per rank whose ``Action.stage`` is the virtual stage (the
chunk index), so the same ``Action`` vocabulary (F/B/W of a micro-batch on a
stage) drives both layouts; with ``v = 1`` a rank schedule is an ordinary
schedule (``stage == rank``).

Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021), K=2, v=2, M=4;
``F2.3`` is the forward of micro-batch 2 on chunk 3::

    rank 0 | F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0
    rank 1 | F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1

Forwards go in groups of K micro-batches through chunk 0, then chunk 1, ...;
backwards mirror them with the chunks reversed. Rank ``k`` runs
``2(K-k-1) + (v-1)K`` warm-up forwards, then alternates. Its bubble is
(K-1)/(v·M+K-1).
"""

from __future__ import annotations

from gpipe_lab.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    get_schedule,
    one_f_one_b_schedule,
    register_schedule,
)


def _check(num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"number of pipeline ranks must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"number of micro-batches (chunks) must be >= 1, got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")


def _grouped_order(num_ranks: int, num_microbatches: int, chunks: list[int]) -> list[tuple[int, int]]:
    """(local chunk, micro-batch) pairs: groups of K micro-batches through each chunk in turn."""
    order = []
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
    _check(num_ranks, num_microbatches, virtual_stages)
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
        validate_rank_schedule(ranks, num_microbatches, v)
    except ValueError as exc:
        raise ValueError(f"interleaved 1F1B with K={K}, v={v} cannot run M={num_microbatches} "
                         f"micro-batches ({exc}); use a multiple of {K}") from None
    return ranks


def looped_gpipe_schedule(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Fill-drain over v chunks per rank: every forward chunk by chunk, then backwards reversed."""
    _check(num_ranks, num_microbatches, virtual_stages)
    K, M, v = num_ranks, num_microbatches, virtual_stages
    return [
        [Action(c * K + k, "F", mb) for c in range(v) for mb in range(M)]
        + [Action(c * K + k, "B", mb) for c in reversed(range(v)) for mb in reversed(range(M))]
        for k in range(K)
    ]


def rank_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Each rank's action list for a named schedule and v virtual stages per rank.

    ``v = 1``: any registered schedule. ``v > 1``: ``"gpipe"`` (looped fill-drain),
    ``"1f1b"`` or ``"interleaved-1f1b"`` (interleaved 1F1B).

    Raises:
        ValueError: unknown name, or a schedule without a virtual-stage form.
    """
    if virtual_stages == 1:
        return get_schedule(name, num_ranks, num_microbatches)
    if name == "gpipe":
        return looped_gpipe_schedule(num_ranks, num_microbatches, virtual_stages)
    if name in ("1f1b", "interleaved-1f1b"):
        return interleaved_1f1b_schedule(num_ranks, num_microbatches, virtual_stages)
    raise ValueError(f"schedule {name!r} has no form with virtual_stages={virtual_stages}; "
                     "allowed: 'gpipe', '1f1b', 'interleaved-1f1b'")


def validate_rank_schedule(ranks: Schedule, num_microbatches: int, virtual_stages: int) -> None:
    """Check a rank schedule: complete, chunk placement ``s mod K``, no deadlock.

    Raises:
        ValueError: naming the offending action or where the ranks wait.
    """
    K = len(ranks)
    S = K * virtual_stages
    expected = {(s, kind, mb) for s in range(S) for kind in "FB" for mb in range(num_microbatches)}
    found = set()
    for k, actions in enumerate(ranks):
        for a in actions:
            if a.stage % K != k or not 0 <= a.stage < S:
                raise ValueError(f"action {a} is on rank {k}, but chunk {a.stage} lives on rank {a.stage % K}")
            if (a.stage, a.kind, a.microbatch) in found:
                raise ValueError(f"action {a} appears twice")
            found.add((a.stage, a.kind, a.microbatch))
    missing = expected - {f for f in found if f[1] in "FB"}
    if missing:
        s, kind, mb = min(missing)
        raise ValueError(f"no {kind} of micro-batch {mb} on virtual stage {s}")
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * K
    while any(cursor[k] < len(ranks[k]) for k in range(K)):
        progressed = False
        for k in range(K):
            while cursor[k] < len(ranks[k]):
                a = ranks[k][cursor[k]]
                if a.kind == "F":
                    deps = [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
                elif a.kind == "B":
                    deps = [(a.stage, "F", a.microbatch)]
                    if a.stage < S - 1:
                        deps.append((a.stage + 1, "B", a.microbatch))
                else:
                    deps = [(a.stage, "B", a.microbatch)]
                if not all(d in done for d in deps):
                    break
                done.add((a.stage, a.kind, a.microbatch))
                cursor[k] += 1
                progressed = True
        if not progressed:
            waiting = [str(ranks[k][cursor[k]]) for k in range(K) if cursor[k] < len(ranks[k])]
            raise ValueError(f"schedule deadlocks; ranks wait at {waiting}")


if "interleaved-1f1b" not in SCHEDULES:
    # one virtual stage per rank: the same lists as 1F1B, usable by every transport
    register_schedule("interleaved-1f1b", lambda k, m: interleaved_1f1b_schedule(k, m, 1))

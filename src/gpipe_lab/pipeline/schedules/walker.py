"""The one step-by-step walk of a schedule: dependencies, completeness, deadlock.

``walk`` runs the action lists on unit clocks: a rank executes its next action
as soon as the action it depends on has run. It returns the actions in an order
that respects every dependency (each rank's own order included), so the
validator (``validate_schedule``) and the simulator (``planner.simulator``) are
the same walk: the validator only needs it to finish; the simulator times each
action along it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpipe_lab.pipeline.schedules.actions import Action, Schedule
from gpipe_lab.pipeline.schedules.placement import looped_placement

MessageKey = tuple[str, int, int]  # ("F" activation | "B" gradient, receiving stage, micro-batch)

# the one dependency rule: a forward waits for the stage before it, a backward for the stage after it
_UPSTREAM = {"F": -1, "B": +1}


def dependency(action: Action, num_stages: int) -> Action | None:
    """The action of a neighbouring stage that ``action`` waits for (None: local input)."""
    step = _UPSTREAM.get(action.kind)
    if step is None or not 0 <= action.stage + step < num_stages:
        return None
    return Action(action.stage + step, action.kind, action.microbatch)


def dependent(action: Action, num_stages: int) -> Action | None:
    """The action of a neighbouring stage that waits for ``action`` (None: the end of the pipeline)."""
    step = _UPSTREAM.get(action.kind)
    if step is None or not 0 <= action.stage - step < num_stages:
        return None
    return Action(action.stage - step, action.kind, action.microbatch)


def incoming(action: Action, num_stages: int) -> MessageKey | None:
    """The message ``action`` consumes: its dependency's result (None: it reads local data)."""
    if dependency(action, num_stages) is None:
        return None
    return (action.kind, action.stage, action.microbatch)


def outgoing(action: Action, num_stages: int) -> MessageKey | None:
    """The message ``action`` produces for its dependent (None: the end of the pipeline)."""
    after = dependent(action, num_stages)
    return None if after is None else incoming(after, num_stages)


def expected_messages(actions: list[Action], placement: int | Sequence[int],
                      num_stages: int) -> dict[MessageKey, int]:
    """The messages one rank's list consumes, in its order, each with the rank that sends it.

    ``placement``: the rank of each stage (``placement.placement_of``), or the number of
    ranks K for the looped placement (stage s on rank s mod K).
    """
    ranks = looped_placement(placement, -(-num_stages // placement)) if isinstance(placement, int) else placement
    out: dict[MessageKey, int] = {}
    for a in actions:
        key, dep = incoming(a, num_stages), dependency(a, num_stages)
        if key is not None and dep is not None:
            out[key] = ranks[dep.stage]
    return out


def walk(schedule: Schedule, num_stages: int | None = None) -> list[tuple[int, Action]]:
    """``(rank, action)`` pairs in an order every rank's list and every dependency allow.

    ``num_stages`` is the number of (virtual) stages S; default: one per rank.

    Raises:
        ValueError: the lists deadlock (the message names where each rank waits).
    """
    S = len(schedule) if num_stages is None else num_stages
    done: set[Action] = set()
    cursor = [0] * len(schedule)
    order: list[tuple[int, Action]] = []
    total = sum(len(actions) for actions in schedule)
    while len(order) < total:
        progressed = False
        for k, actions in enumerate(schedule):
            while cursor[k] < len(actions):
                a = actions[cursor[k]]
                dep = dependency(a, S)
                if dep is not None and dep not in done:
                    break
                done.add(a)
                order.append((k, a))
                cursor[k] += 1
                progressed = True
        if not progressed:
            waiting = [str(actions[cursor[k]]) for k, actions in enumerate(schedule) if cursor[k] < len(actions)]
            raise ValueError(f"schedule deadlocks; stages wait at {waiting}")
    return order


def validate_schedule(schedule: Schedule, num_microbatches: int, virtual_stages: int = 1,
                      placement: Sequence[int] | None = None) -> None:
    """Check that a schedule is complete and can run without deadlock.

    Each (virtual) stage must hold exactly one F and one B per micro-batch (and at
    most one W, after its B), on the rank ``placement[stage]`` (default: ``stage mod K``);
    B after F on the same stage; a forward needs the previous stage's forward, a backward
    the next stage's backward (checked by ``walk``).

    Raises:
        ValueError: naming the offending action, or where the stages wait.
    """
    K = len(schedule)
    S = K * virtual_stages
    ranks = looped_placement(K, virtual_stages) if placement is None else tuple(placement)
    if len(ranks) != S or any(not 0 <= r < K for r in ranks):
        raise ValueError(f"placement {list(ranks)} must give one rank in 0..{K - 1} for each of the {S} stages")
    positions: dict[tuple[int, str, int], int] = {}
    for k, actions in enumerate(schedule):
        for pos, a in enumerate(actions):
            if not 0 <= a.stage < S or ranks[a.stage] != k:
                if not 0 <= a.stage < S:
                    raise ValueError(f"action {a}: stage outside 0..{S - 1}")
                if virtual_stages == 1 and placement is None:
                    raise ValueError(f"action {a} is in the list of stage {k}")
                raise ValueError(f"action {a} is on rank {k}, but chunk {a.stage} lives on rank {ranks[a.stage]}")
            if not 0 <= a.microbatch < num_microbatches:
                raise ValueError(f"action {a}: micro-batch outside 0..{num_microbatches - 1}")
            if (a.stage, a.kind, a.microbatch) in positions:
                raise ValueError(f"action {a} appears twice on stage {a.stage}")
            positions[(a.stage, a.kind, a.microbatch)] = pos
    for s in range(S):
        for i in range(num_microbatches):
            for kind in ("F", "B"):
                if (s, kind, i) not in positions:
                    raise ValueError(f"stage {s} has no {kind} for micro-batch {i}")
            if positions[(s, "B", i)] < positions[(s, "F", i)]:
                raise ValueError(f"stage {s}: B{i} before F{i}")
            if (s, "W", i) in positions and positions[(s, "W", i)] < positions[(s, "B", i)]:
                raise ValueError(f"stage {s}: W{i} before B{i}")
    walk(schedule, S)


def validate_rank_schedule(ranks: Schedule, num_microbatches: int, virtual_stages: int,
                           placement: Sequence[int] | None = None) -> None:
    """``validate_schedule`` for v virtual stages per rank (a public name).

    Raises:
        ValueError: naming the offending action or where the ranks wait.
    """
    validate_schedule(ranks, num_microbatches, virtual_stages, placement)

"""Schedules as data: each stage's ordered list of actions.

A schedule generator is a pure function ``(num_stages, num_microbatches) ->
list[list[Action]]``; element ``k`` is what stage ``k`` executes, in order.
The same lists drive the executor (local threads or torch.distributed) and
the simulator, so a timeline can be predicted before it is measured.

Fill-drain (GPipe), K=3, M=4; ``F3`` = forward of micro-batch 3, ``B3`` its
backward; one column per clock tick when all actions cost the same::

    stage 0 | F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    stage 1 | .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    stage 2 | .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

1F1B runs ``K-k-1`` warm-up forwards on stage ``k``, then alternates one
forward and one backward, so at most ``K - k`` micro-batches are alive there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Action:
    """One unit of work of one stage.

    ``F``: forward of a micro-batch. ``B``: backward; it computes the gradient of
    the stage input, and also the weight gradients unless the same stage's list
    holds a ``W`` for that micro-batch (split backward, zero-bubble schedules).
    ``W``: the deferred weight gradients of a micro-batch.
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


Schedule = list[list[Action]]
ScheduleFn = Callable[[int, int], Schedule]


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"number of stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"number of micro-batches (chunks) must be >= 1, got {num_microbatches}")


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain: all forwards, then all backwards in reverse micro-batch order."""
    _check(num_stages, num_microbatches)
    return [
        [Action(k, "F", i) for i in range(num_microbatches)]
        + [Action(k, "B", i) for i in reversed(range(num_microbatches))]
        for k in range(num_stages)
    ]


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: ``K-k-1`` warm-up forwards, then alternate one forward, one backward."""
    _check(num_stages, num_microbatches)
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


SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
}


def register_schedule(name: str, fn: ScheduleFn) -> None:
    """Make a schedule generator selectable by name (e.g. ``zb-h1``)."""
    SCHEDULES[name] = fn


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Return the action lists of the named schedule.

    Raises:
        ValueError: unknown schedule name (the message lists the known ones).
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; allowed: {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


def analytic_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a fill-drain (or 1F1B) step: (K-1)/(v·M+K-1)."""
    _check(num_stages, num_microbatches)
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


def validate_schedule(schedule: Schedule, num_microbatches: int) -> None:
    """Check that a schedule is complete and can run without deadlock.

    Each stage must hold exactly one F and one B per micro-batch (and at most one
    W, after its B); B after F on the same stage; a forward needs the previous
    stage's forward, a backward the next stage's backward. Deadlock freedom is
    checked by running the lists on unit-time clocks.

    Raises:
        ValueError: naming the offending action.
    """
    num_stages = len(schedule)
    for k, actions in enumerate(schedule):
        seen: dict[tuple[str, int], int] = {}
        for pos, a in enumerate(actions):
            if a.stage != k:
                raise ValueError(f"action {a} is in the list of stage {k}")
            if not 0 <= a.microbatch < num_microbatches:
                raise ValueError(f"action {a}: micro-batch outside 0..{num_microbatches - 1}")
            if (a.kind, a.microbatch) in seen:
                raise ValueError(f"action {a} appears twice on stage {k}")
            seen[(a.kind, a.microbatch)] = pos
        for i in range(num_microbatches):
            for kind in ("F", "B"):
                if (kind, i) not in seen:
                    raise ValueError(f"stage {k} has no {kind} for micro-batch {i}")
            if seen[("B", i)] < seen[("F", i)]:
                raise ValueError(f"stage {k}: B{i} before F{i}")
            if ("W", i) in seen and seen[("W", i)] < seen[("B", i)]:
                raise ValueError(f"stage {k}: W{i} before B{i}")
    done: set[Action] = set()
    cursor = [0] * num_stages
    while any(cursor[k] < len(schedule[k]) for k in range(num_stages)):
        progressed = False
        for k in range(num_stages):
            if cursor[k] >= len(schedule[k]):
                continue
            a = schedule[k][cursor[k]]
            if a.kind == "F" and k > 0:
                dep: Action | None = Action(k - 1, "F", a.microbatch)
            elif a.kind == "B" and k < num_stages - 1:
                dep = Action(k + 1, "B", a.microbatch)
            else:
                dep = None
            if dep is None or dep in done:
                done.add(a)
                cursor[k] += 1
                progressed = True
        if not progressed:
            waiting = [str(schedule[k][cursor[k]]) for k in range(num_stages) if cursor[k] < len(schedule[k])]
            raise ValueError(f"schedule deadlocks; stages wait at {waiting}")


def weight_runs(actions: Sequence[Action]) -> dict[int, dict[int, tuple[int, ...]]]:
    """Consecutive ``W`` actions of one stage, in one executor's order: ``{stage: {mb: run}}``.

    A stage runs each run's weight gradients together, at the run's last ``W``
    (one GEMM per layer over all its micro-batches, see ``linear_weights``).
    """
    runs: dict[int, dict[int, tuple[int, ...]]] = {}
    current: list[Action] = []

    def close() -> None:
        run = tuple(a.microbatch for a in current)
        for a in current:
            runs.setdefault(a.stage, {})[a.microbatch] = run
        current.clear()

    for action in actions:
        if action.kind == "W" and (not current or current[-1].stage == action.stage):
            current.append(action)
            continue
        close()
        if action.kind == "W":
            current.append(action)
    close()
    return runs

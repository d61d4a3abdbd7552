"""The schedule vocabulary: ``Action`` (F, B or W of a micro-batch on a stage) and its checks.

A schedule is data: element ``k`` of a ``Schedule`` is the ordered action list of
pipeline rank ``k``. ``Action.stage`` is the (virtual) stage the action runs: with
one stage per rank ``stage == k``; with v virtual stages per rank, rank ``k`` holds
stages ``k, k+K, ..., k+(v-1)K``. The same lists drive both transports and the
simulator.
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


def check_sizes(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Reject sizes no schedule can have.

    Raises:
        ValueError: a count below 1, naming it and its value.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"number of stages must be an integer >= 1, got {num_stages!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"number of micro-batches (chunks) must be an integer >= 1, got {num_microbatches!r}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")


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

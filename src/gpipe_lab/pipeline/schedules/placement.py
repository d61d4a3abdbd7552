"""Stage placement: which pipeline rank holds each (virtual) stage, as part of a schedule's data.

A placement is a tuple ``p`` with ``p[s]`` the rank of stage ``s``. Two are built in:

* ``looped``: stage ``s`` on rank ``s mod K`` (one stage per rank, interleaved 1F1B);
* ``v``: the V of ZB-V and DualPipeV: chunk ``c`` runs down the ranks when ``c`` is even and
  back up when odd, so with v = 2 rank ``r`` holds stages ``r`` and ``2K-1-r`` and the last
  stage sits beside the first (K=3: ranks 0 1 2 2 1 0).

A schedule's rank lists carry their placement (each action is in its rank's list):
``placement_of`` reads it back, once per schedule, for the executor, the links and the
simulator; the registry's placement function (``catalog``) gives it before any list exists,
for placing the stages' layers on devices, and the validator checks that the two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpipe_lab.pipeline.schedules.actions import Schedule

Placement = tuple[int, ...]
PlacementFn = Callable[[int, int], Placement]  # (ranks K, virtual stages v) -> rank of each of the K·v stages


def looped_placement(num_ranks: int, virtual_stages: int = 1) -> Placement:
    """Stage ``s`` on rank ``s mod K``."""
    return tuple(s % num_ranks for s in range(num_ranks * virtual_stages))


def v_placement(num_ranks: int, virtual_stages: int = 2) -> Placement:
    """Chunk ``c`` down the ranks (``c`` even) or back up (odd): rank r holds r and 2K-1-r for v = 2."""
    K = num_ranks
    return tuple(s % K if (s // K) % 2 == 0 else K - 1 - s % K for s in range(K * virtual_stages))


PLACEMENTS: dict[str, PlacementFn] = {"looped": looped_placement, "v": v_placement}


def placement_of(schedule: Schedule, num_stages: int | None = None) -> Placement:
    """The rank of each stage, read from the lists: the rank whose list holds the stage's actions.

    ``num_stages`` S (default: the highest stage seen + 1); a stage with no action (an
    empty list) falls back to ``s mod K``.

    Raises:
        ValueError: a stage whose actions are in two ranks' lists (naming the action).
    """
    K = len(schedule)
    seen: dict[int, int] = {}
    for k, actions in enumerate(schedule):
        for a in actions:
            if seen.setdefault(a.stage, k) != k:
                raise ValueError(f"action {a} is on rank {k}, but stage {a.stage} runs on rank {seen[a.stage]}")
    S = num_stages if num_stages is not None else (max(seen) + 1 if seen else K)
    return tuple(seen.get(s, s % K) for s in range(S))


def stages_on(placement: Sequence[int], rank: int) -> list[int]:
    """The stages rank ``rank`` holds, in stage order."""
    return [s for s, r in enumerate(placement) if r == rank]

"""Stages that slow each other down: an action's cost moves between its alone and its contended time.

CPU stages are threads of one process. They share the interpreter lock and the
memory bandwidth, so an action runs slower while another stage is computing
than while the others wait, most of all on small micro-batches whose time goes
to Python dispatch.
Each action therefore has two measured costs, ``alone`` and ``contended`` (timed
while a second thread runs the same kind of action), and takes

    alone + share x (contended - alone)

where ``share`` is the part of its span during which some other stage computes.
The shares depend on the timeline and the timeline on the costs, so the step
is simulated again with the new costs until no action moves (a fixed point,
damped so that it cannot oscillate). With one stage, or with ``contended`` equal
to ``alone``, the result is the plain simulation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpipe_lab.pipeline.measuring.step_timeline import Timeline
from gpipe_lab.pipeline.schedules import Schedule, placement_of
from gpipe_lab.planner.simulator import Prediction, StageCosts, by_rank, predict_step, simulate_stages

Key = tuple[int, str, int]


def busy_shares(timeline: Timeline, placement: int | Sequence[int] | None = None) -> dict[Key, float]:
    """For each action ``(stage, kind, micro-batch)``, the share of its span during which at least
    one other rank runs an action (waits are not work). A timeline by virtual stage gives the
    ``placement`` (the rank of each stage; an int K: stage s on rank ``s % K``); default: one
    stage per rank."""
    S = timeline.num_stages
    ranks = S if placement is None else placement
    rank_of = [s % ranks for s in range(S)] if isinstance(ranks, int) else list(ranks)
    work = [e for e in timeline.events if e.kind != "wait"]
    shares: dict[Key, float] = {}
    for k in range(max(rank_of, default=-1) + 1):
        others = _union((e.start, e.end) for e in work if rank_of[e.stage] != k)
        for e in work:
            if rank_of[e.stage] == k:
                shares[(e.stage, e.kind, e.microbatch)] = _covered(e.start, e.end, others) / e.duration \
                    if e.duration > 0 else 0.0
    return shares


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans if a < end and b > start)


def predict_contended(schedule: Schedule, costs: StageCosts, alone: Mapping[Key, float],
                      contended: Mapping[Key, float], checkpointed: Iterable[int] = (),
                      rounds: int = 50, tolerance: float = 1e-9) -> Prediction:
    """The step of ``schedule`` where each action costs between its ``alone`` and ``contended`` seconds
    by the share of it that overlaps another stage's work (see the module docstring).

    ``costs`` supplies the hand-over per hop (and the costs of any action missing from ``alone``).

    Raises:
        ValueError: ``alone`` and ``contended`` cover different actions, ``rounds`` < 1, or what
            ``simulator.simulate`` raises.
    """
    if set(alone) != set(contended):
        raise ValueError(f"alone and contended costs cover different actions: "
                         f"{sorted(set(alone) ^ set(contended))[:4]}...")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    replayed = list(checkpointed)
    durations = dict(alone)
    ranks = len(schedule)
    if ranks < 2:
        return predict_step(schedule, costs, replayed, durations)
    stages = simulate_stages(schedule, costs, replayed, durations)
    placement = placement_of(schedule, stages.num_stages)
    for _ in range(rounds):
        shares = busy_shares(stages, placement)
        target = {key: a + shares.get(key, 0.0) * (contended[key] - a) for key, a in alone.items()}
        moved = max((abs(target[key] - durations[key]) for key in durations), default=0.0)
        # halfway to the target: a step whose actions stop overlapping once slowed cannot flip forever
        durations = {key: 0.5 * (durations[key] + target[key]) for key in durations}
        stages = simulate_stages(schedule, costs, replayed, durations)
        if moved <= tolerance * max(stages.wall, 1e-12):
            break
    timeline = by_rank(stages, placement)
    return Prediction(timeline, timeline.wall, timeline.measured_bubble())

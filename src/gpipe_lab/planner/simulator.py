"""Predict a schedule's timeline from per-action costs, before (or beside) measuring it.

The simulator runs the SAME action lists as the executor (``schedule.Action``)
on virtual clocks:

* a stage executes its list in order, one action at a time;
* ``F(k, i)`` starts after ``F(k-1, i)`` ended plus the transfer time of hop k-1;
* ``B(k, i)`` starts after ``B(k+1, i)`` ended plus the transfer time of hop k;
* ``W(k, i)`` after its own ``B`` (list order guarantees it);
* a checkpointed micro-batch replays its forward (``R``) when its ``B`` starts,
  as the executor does, then runs ``B``;
* ``B`` costs ``backward_input`` when the stage's list holds a ``W`` for that
  micro-batch (split backward), ``backward_input + backward_weight`` otherwise.

The prediction is a ``gpipe_lab.pipeline.Timeline`` (start 0, events F, B, W,
R and ``wait`` where a stage idles on a neighbour), so it is drawn and
measured (``measured_bubble``) exactly like a real step.

    costs = StageCosts.uniform(4, forward=1, backward_input=1, backward_weight=1)
    pred = predict_step(get_schedule("zb-h1", 4, 8), costs)
    pred.step_time, pred.bubble
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpipe_lab.pipeline.measuring.step_timeline import Event, Timeline
from gpipe_lab.pipeline.schedules import Action, Schedule, dependency, get_schedule, placement_of, walk


@dataclass(frozen=True)
class StageCosts:
    """Seconds (or any unit) per action, per stage.

    ``transfer[k]`` is the hop between stage k and k+1 (both directions); the
    list may have K-1 or K entries. ``recompute`` defaults to ``forward``.

    Raises:
        ValueError: lists of different lengths, or a negative cost.
    """

    forward: Sequence[float]
    backward_input: Sequence[float]
    backward_weight: Sequence[float]
    recompute: Sequence[float] | None = None
    transfer: Sequence[float] | None = None

    def __post_init__(self) -> None:
        k = len(self.forward)
        for name in ("backward_input", "backward_weight", "recompute"):
            values = getattr(self, name)
            if values is not None and len(values) != k:
                raise ValueError(f"{name} has {len(values)} entries but forward has {k} (one per stage)")
        if self.transfer is not None and len(self.transfer) not in (max(k - 1, 0), k):
            raise ValueError(f"transfer has {len(self.transfer)} entries; need {k - 1} (one per hop) or {k}")
        for name in ("forward", "backward_input", "backward_weight", "recompute", "transfer"):
            values = getattr(self, name) or []
            if any(v < 0 for v in values):
                raise ValueError(f"{name} holds a negative cost: {list(values)}")

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward_input: float = 1.0,
                backward_weight: float = 1.0, recompute: float | None = None,
                transfer: float = 0.0) -> StageCosts:
        """The same costs on every stage."""
        k = num_stages
        return cls([forward] * k, [backward_input] * k, [backward_weight] * k,
                   None if recompute is None else [recompute] * k, [transfer] * max(k - 1, 0))

    def hop(self, k: int) -> float:
        """Transfer time between stage k and k+1."""
        return 0.0 if not self.transfer or k >= len(self.transfer) else float(self.transfer[k])


@dataclass
class Prediction:
    """A predicted step: its timeline, wall time and bubble (1 - busy / (K · wall))."""

    timeline: Timeline
    step_time: float
    bubble: float


def simulate_stages(schedule: Schedule, costs: StageCosts, checkpointed: Iterable[int] = (),
                    durations: Mapping[tuple[int, str, int], float] | None = None) -> Timeline:
    """Run the action lists on virtual clocks; return the predicted timeline by (virtual) stage:
    ``Timeline(S, ...)`` whose events carry the stage each action runs (on the rank whose list holds
    it: the schedule's placement). With one stage per rank it is ``simulate``'s timeline. A hand-over
    between two stages of one rank (the V schedules' turn) costs no transfer.

    ``costs`` has one entry per stage (S = K·v with v virtual stages per rank) and a transfer per
    hop between neighbouring stages. ``durations`` maps ``(stage, kind, micro-batch)`` to the
    seconds of that one action (kinds F, B, W, R), overriding the per-stage costs; with a measured
    step's ``durations_from_timeline`` the result is that step replayed with no hand-over delays:
    the earliest each action could have started.

    Raises:
        ValueError: costs for a different number of stages than the schedule's actions run, or a
            schedule that deadlocks (the message names the actions each stage waits at).
    """
    K = len(schedule)
    S = costs.num_stages
    stages = 1 + max((a.stage for actions in schedule for a in actions), default=K - 1)
    if S != stages or S % max(K, 1):
        raise ValueError(f"costs are for {S} stages but the schedule has {stages}")
    try:
        order = walk(schedule, S)
    except ValueError as exc:
        raise ValueError(f"{exc} (in the simulator)") from None
    recompute = costs.recompute if costs.recompute is not None else costs.forward
    replayed = frozenset(checkpointed)
    split = {(a.stage, a.microbatch) for actions in schedule for a in actions if a.kind == "W"}
    rank_of = placement_of(schedule, S)
    end: dict[Action, float] = {}
    free = [0.0] * K  # per rank: its stages run one action at a time
    own = durations or {}
    events: list[Event] = []
    for k, a in order:
        s = a.stage
        if a.kind == "B" and a.microbatch in replayed:
            # the engine re-materializes before it waits for the gradient
            took = own.get((s, "R", a.microbatch), recompute[s])
            events.append(Event(s, "R", a.microbatch, free[k], free[k] + took))
            free[k] += took
        dep = dependency(a, S)
        hop = 0.0 if dep is None or rank_of[dep.stage] == k else costs.hop(min(dep.stage, s))
        ready = 0.0 if dep is None else end[dep] + hop
        start = max(free[k], ready)
        if start > free[k]:
            events.append(Event(s, "wait", a.microbatch, free[k], start))
        if a.kind == "F":
            duration = costs.forward[s]
        elif a.kind == "B":
            duration = costs.backward_input[s]
            if (s, a.microbatch) not in split:
                duration += costs.backward_weight[s]
        else:
            duration = costs.backward_weight[s]
        duration = own.get((s, a.kind, a.microbatch), duration)
        events.append(Event(s, a.kind, a.microbatch, start, start + duration))
        end[a] = free[k] = start + duration
    events.sort(key=lambda e: (e.start, e.stage))
    return Timeline(S, 0.0, max(free, default=0.0), events)


def by_rank(timeline: Timeline, placement: int | Sequence[int]) -> Timeline:
    """A timeline by stage as the executor records it: each event on its rank (``placement[stage]``;
    an int K: ``stage % K``)."""
    rank_of = [s % placement for s in range(timeline.num_stages)] if isinstance(placement, int) else placement
    num_ranks = max(rank_of, default=-1) + 1
    if timeline.num_stages == num_ranks and all(r == s for s, r in enumerate(rank_of)):
        return timeline
    events = [Event(rank_of[e.stage], e.kind, e.microbatch, e.start, e.end) for e in timeline.events]
    return Timeline(num_ranks, timeline.start, timeline.end, events)


def simulate(schedule: Schedule, costs: StageCosts, checkpointed: Iterable[int] = (),
             durations: Mapping[tuple[int, str, int], float] | None = None) -> Timeline:
    """The predicted timeline of ``schedule`` by rank (starts at 0), as the executor records a real
    step: ``simulate_stages`` with each event on its rank.

    Raises:
        ValueError: as ``simulate_stages``.
    """
    stages = simulate_stages(schedule, costs, checkpointed, durations)
    return by_rank(stages, placement_of(schedule, stages.num_stages))


def predict_step(schedule: Schedule, costs: StageCosts, checkpointed: Iterable[int] = (),
                 durations: Mapping[tuple[int, str, int], float] | None = None) -> Prediction:
    """Predicted step time and bubble of ``schedule`` under ``costs`` (see ``simulate``)."""
    timeline = simulate(schedule, costs, checkpointed, durations)
    return Prediction(timeline, timeline.wall, timeline.measured_bubble())


def durations_from_timeline(timeline: Timeline) -> dict[tuple[int, str, int], float]:
    """Each action's measured seconds, keyed ``(stage, kind, micro-batch)`` (waits left out)."""
    return {(e.stage, e.kind, e.microbatch): e.duration for e in timeline.events if e.kind != "wait"}


def costs_from_timeline(timeline: Timeline | Sequence[Timeline],
                        weight_share: float | None = None) -> StageCosts:
    """Per-stage median action times measured in a real step, as simulator costs.

    Given several steps' timelines, each cost is the median over the steps
    (robust to a step disturbed by other work on the machine).

    ``B`` events of micro-batches that also have a ``W`` measure the input
    gradient alone. A stage whose timeline holds no ``W`` measured full
    backwards: they are split as ``weight_share`` (e.g. 0.5) of weight
    gradients, or, without it, counted entirely as ``backward_input`` (then
    predict only schedules without ``W`` from these costs). Transfer per hop:
    the median delay between a neighbour's action ending and the dependent
    action starting on a stage that was idle (thread hand-over, copies).

    Raises:
        ValueError: a stage without F or B events, or ``weight_share`` outside [0, 1].
    """
    if weight_share is not None and not 0.0 <= weight_share <= 1.0:
        raise ValueError(f"weight_share must be in [0, 1], got {weight_share}")
    if not isinstance(timeline, Timeline):
        if not timeline:
            raise ValueError("no timelines given")
        each = [costs_from_timeline(t, weight_share) for t in timeline]
        fields = ("forward", "backward_input", "backward_weight", "recompute", "transfer")
        return StageCosts(*([statistics.median(vals) for vals in zip(*(getattr(c, f) for c in each))]
                            for f in fields))
    K = timeline.num_stages
    by: dict[tuple[int, str], dict[int, Event]] = {}
    for e in timeline.events:
        by.setdefault((e.stage, e.kind), {})[e.microbatch] = e
    fwd, bin_, bw, rec = [], [], [], []
    for k in range(K):
        f, b, w, r = (by.get((k, kind), {}) for kind in ("F", "B", "W", "R"))
        if not f or not b:
            raise ValueError(f"stage {k} has no {'F' if not f else 'B'} events in the timeline")
        fwd.append(statistics.median(e.duration for e in f.values()))
        rec.append(statistics.median(e.duration for e in r.values()) if r else fwd[-1])
        if w:
            bin_.append(statistics.median(b[i].duration for i in w if i in b))
            bw.append(statistics.median(e.duration for e in w.values()))
        else:
            full = statistics.median(e.duration for e in b.values())
            share = weight_share or 0.0
            bin_.append(full * (1.0 - share))
            bw.append(full * share)
    return StageCosts(fwd, bin_, bw, rec, _hop_delays(timeline, by))


def _hop_delays(timeline: Timeline, by: dict[tuple[int, str], dict[int, Event]]) -> list[float]:
    K = timeline.num_stages
    previous_end: dict[Event, float] = {}
    for k in range(K):
        compute = sorted((e for e in timeline.events if e.stage == k and e.kind != "wait"),
                         key=lambda e: e.start)
        for before, after in zip(compute, compute[1:]):
            previous_end[after] = before.end
    hops = []
    for k in range(K - 1):
        delays = []
        for kind, src, dst in (("F", k, k + 1), ("B", k + 1, k)):
            for i, sent in by.get((src, kind), {}).items():
                got = by.get((dst, "R" if (dst, "R") in by and i in by[(dst, "R")] else kind), {}).get(i)
                if got is not None and previous_end.get(got, timeline.start) < sent.end <= got.start:
                    delays.append(got.start - sent.end)
        hops.append(statistics.median(delays) if delays else 0.0)
    return hops


def unit_cost_bubble(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The named schedule's own bubble: the idle fraction of its lists when every F, B and W of a
    stage costs the same (a stage being 1/v of a rank's layers) and hand-overs cost nothing.

    Raises:
        ValueError: as ``get_schedule``.
    """
    unit = 1.0 / virtual_stages
    lists = get_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    return predict_step(lists, StageCosts.uniform(num_ranks * virtual_stages, unit, unit, unit)).bubble

"""The planner's rank step: the plans that fit, fastest predicted first, and why each runner-up lost.

Simulating every plan would be slow, so ``rank`` simulates few (see its docstring): plans are taken in
the order of a cheap lower bound, predicted with stages alone, and only the best are predicted in full
(stages slowing each other: ``planner.contention``). Within ``TIE`` of the fastest the smaller peak
memory wins, then the simpler schedule and less re-materialization. ``runners_up`` names the next
fastest plans (slower by x%) and the chosen plan's neighbours that do not fit (over memory on stage
k); ``no_fit`` is the refusal when nothing fits: the least memory any plan needs, and its plan.
"""

from __future__ import annotations

import dataclasses
import heapq

from gpipe_lab.planner.cost_model import CostModel, Split
from gpipe_lab.planner.memory import format_bytes
from gpipe_lab.planner.plan_types import CHECKPOINTS, NoPlanFits, Scored

__all__ = ["TIE", "no_fit", "predict", "rank", "runners_up"]

#: predicted steps within this fraction of each other are a tie
TIE = 1e-3
#: checkpoint modes from the most to the least activation memory kept
_LESS_REMAT = {"always": "except_last", "except_last": "never"}


def predict(s: Scored, cost: CostModel, batch: int, split: Split | None) -> None:
    """Fill ``s``'s predicted step and bubble from ``cost``."""
    pred = cost.predict_options(s.candidate.options, batch, split)
    s.step_time, s.bubble = pred.step_time, pred.bubble


def rank(fitting: list[Scored], cost: CostModel, batch: int, top: int, schedules: list[str],
         split: Split | None) -> int:
    """Sort ``fitting`` so that its first ``top`` are the fastest by the full (contended) prediction;
    returns how many were fully simulated (the sorted prefix).

    Two lower bounds keep the simulations few: ``CostModel.lower_bound`` (no device finishes before its
    own actions, no micro-batch before its path through every stage) and the prediction with stages
    alone (stages only slow each other). Plans are fully simulated in the order of their stages-alone
    predictions, each simulated alone only once its cheap bound is the lowest left, until no bound can
    beat the ``top``-th best found. Within ``TIE`` of the fastest (a tie), the smaller peak memory
    wins, then the earlier of ``schedules`` and less re-materialization.
    """
    bounds = {id(s): cost.lower_bound(s.candidate.options, batch, split) for s in fitting}
    order = sorted(fitting, key=lambda s: bounds[id(s)])
    alone_cost = dataclasses.replace(cost, contended=None)
    alone: list[tuple[float, int, Scored]] = []  # a heap of (prediction with stages alone, order, plan)
    done: list[Scored] = []
    i = 0
    while True:
        best = sorted(x.step_time or 0.0 for x in done)
        limit = best[top - 1] * (1 + TIE) if len(best) >= top else float("inf")
        # the cheap bounds admit a plan to the stages-alone prediction, that bound to the full one
        while i < len(order) and bounds[id(order[i])] <= limit and (not alone or bounds[id(order[i])] <= alone[0][0]):
            predict(order[i], alone_cost, batch, split)
            heapq.heappush(alone, (order[i].step_time or 0.0, i, order[i]))
            i += 1
        if not alone or alone[0][0] > limit:
            break
        s = heapq.heappop(alone)[2]
        if cost.contended is not None and s.candidate.options.num_stages > 1:
            predict(s, cost, batch, split)
        done.append(s)
    fastest = min(x.step_time or 0.0 for x in done)

    def key(s: Scored) -> tuple[bool, float, float, int, int]:
        o = s.candidate.options
        tied = (s.step_time or 0.0) <= fastest * (1 + TIE)
        return (not tied, 0.0 if tied else s.step_time or 0.0, s.peak_bytes, schedules.index(o.schedule),
                CHECKPOINTS.index(o.checkpoint))

    done.sort(key=key)
    chosen = {id(x) for x in done}
    fitting[:] = done + [x for x in order if id(x) not in chosen]
    return len(done)


def _over_reason(s: Scored, budget: float) -> str:
    k = max(range(len(s.stage_bytes)), key=lambda i: s.stage_bytes[i])
    return f"over memory on stage {k}: {format_bytes(s.stage_bytes[k])} > {format_bytes(budget)}"


def runners_up(chosen: Scored, rest: list[Scored], over: list[Scored], budget: float, count: int) -> list[Scored]:
    """The next fastest fitting plans of ``rest`` (slower by x%), then the chosen plan's neighbours of
    ``over`` that do not fit: less re-materialization, twice fewer micro-batches, or one stage fewer,
    each with the same schedule."""
    out: list[Scored] = []
    seen: set[tuple[int, int, str, str]] = set()

    def same(a: Scored, b: Scored) -> bool:  # an equivalent plan (e.g. gpipe-bw at M=1) says nothing new
        return (abs((a.step_time or 0.0) - (b.step_time or 0.0)) <= TIE * (b.step_time or 0.0)
                and abs(a.peak_bytes - b.peak_bytes) <= TIE * b.peak_bytes)

    def setting(s: Scored) -> tuple[int, int, str, str]:  # a plan but its balance
        o = s.candidate.options
        return o.num_stages, o.chunks, o.schedule, o.checkpoint

    for s in rest:
        if setting(s) in seen or any(same(s, x) for x in [chosen, *out]):
            continue  # the other balance of a listed setting, or an equivalent plan
        seen.add(setting(s))
        assert s.step_time is not None and chosen.step_time is not None  # ``rest`` was simulated
        s.reason = (f"slower by {s.step_time / chosen.step_time - 1:.1%}" if s.step_time > chosen.step_time * (1 + TIE)
                    else f"as fast (within {TIE:.1%}), more memory: {format_bytes(s.peak_bytes)}")
        out.append(s)
        if len(out) == count:
            break
    k, m, schedule, checkpoint = setting(chosen)
    wanted = [(k, m, schedule, _LESS_REMAT.get(checkpoint)), (k, m // 2, schedule, checkpoint),
              (k - 1, m, schedule, checkpoint)]
    for want in wanted:
        match = [s for s in over if setting(s) == want]
        if match:
            best = min(match, key=lambda s: s.peak_bytes)
            best.reason = _over_reason(best, budget)
            out.append(best)
    return out


def no_fit(over: list[Scored], cost: CostModel, budget: float, batch: int, split: Split | None) -> NoPlanFits:
    """The refusal: the least memory any plan of ``over`` needs, and the fastest plan at that memory."""
    least = min(s.peak_bytes for s in over)
    tied = [s for s in over if s.peak_bytes <= least * (1 + 1e-9)]
    for s in tied:
        predict(s, cost, batch, split)
    best = min(tied, key=lambda s: s.step_time or 0.0)
    return NoPlanFits(f"no plan fits {format_bytes(budget)} per device; the smallest memory that fits is "
                      f"{format_bytes(least)} ({int(least)} bytes), with {best.candidate.describe()}", best)

"""``plan_auto``: the fastest pipeline plan (K, M, balance, schedule, checkpoint) that fits a memory budget.

Every candidate is built from a measured ``Profile`` (``planner.profile_cache``):

- K from 1 to the devices available (and the layers), and for ``interleaved-1f1b`` v virtual stages per
  device (``VIRTUAL_STAGES``: K·v stages, stage s on device s % K); M from 1, 2, 4, ... up to ``max_microbatches``,
  dividing the mini-batch, whose micro-batch size the profile measured (a size the model cannot
  train on, e.g. BatchNorm over one value, is never planned); each balance ``balance_by_cost`` gives for the per-layer time (forward +
  backward at that micro-batch size) and for the per-layer memory; each allowed schedule; each
  checkpoint mode (``never``, ``except_last``, ``always``).
- Memory first (``planner.stage_memory``): a candidate over the budget on any stage is never simulated.
- The rest are simulated by the cost model (the same action lists the executor runs; a split
  backward's B and W cost what the profile measured them to, as multiples of the full backward) and
  ranked by predicted step time; ties go to the smaller peak memory, then the simpler schedule.

The result names the chosen plan and runner-ups, each with why it lost: slower by x%, or over
memory on stage k (the chosen plan's neighbours that keep more activations or use fewer stages).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence

from gpipe_lab.pipeline.partitioning.partition import balance_by_cost
from gpipe_lab.pipeline.schedules import get_schedule
from gpipe_lab.pipeline.step.batching import checkpointed_microbatches
from gpipe_lab.planner.cost_model import CostModel
from gpipe_lab.planner.memory_size import format_bytes
from gpipe_lab.planner.plan_types import Candidate, NoPlanFits, PlanResult, Scored
from gpipe_lab.planner.profile_cache import Profile
from gpipe_lab.planner.stage_memory import StageMemoryModel

__all__ = ["CHECKPOINTS", "DEFAULT_SCHEDULES", "VIRTUAL_STAGES", "Candidate", "NoPlanFits", "PlanResult", "Scored", "candidates",
           "microbatch_counts", "plan_auto"]

#: Searched by default; ``interleaved-1f1b`` with ``VIRTUAL_STAGES`` per device (with one it is ``1f1b``).
DEFAULT_SCHEDULES = ("gpipe", "gpipe-bw", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
#: virtual stages per device searched for ``interleaved-1f1b`` (K >= 2, K·v <= the layers)
VIRTUAL_STAGES = (2, 4)
CHECKPOINTS = ("never", "except_last", "always")
#: schedules whose backward is split into B and W (``_bound`` lets B + W cost their least)
SPLIT_BACKWARD = ("gpipe-bw", "zb-h1", "zb-h2")
#: predicted steps within this fraction of each other are a tie
TIE = 1e-3
#: checkpoint modes from the most to the least activation memory kept
_LESS_REMAT = {"always": "except_last", "except_last": "never"}


def microbatch_counts(batch: int, max_microbatches: int) -> list[int]:
    """1, 2, 4, ... up to ``max_microbatches`` and ``batch``, each dividing ``batch``."""
    out, m = [], 1
    while m <= min(batch, max_microbatches):
        if batch % m == 0:
            out.append(m)
        m *= 2
    return out


def _balances(profile: Profile, cost: CostModel, memory: StageMemoryModel, k: int, micro: int,
              ) -> list[tuple[int, ...]]:
    """The time-balanced and the memory-balanced cut into ``k`` stages (one if they agree)."""
    if k == 1:
        return [(profile.num_layers,)]
    seconds = [a + b for a, b in zip(*(cost.stage_seconds(kind, [1] * profile.num_layers, micro)
                                       for kind in ("forward_grad", "backward")))]
    out = [tuple(balance_by_cost(seconds, k))]
    by_memory = tuple(balance_by_cost(memory.layer_weights(micro), k))
    if by_memory not in out:
        out.append(by_memory)
    return out


def _check_schedules(schedules: Sequence[str]) -> list[str]:
    from gpipe_lab.pipeline.schedules import SCHEDULES

    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"schedules: {list(schedules)} must be a non-empty list of {sorted(SCHEDULES)}")
    return list(dict.fromkeys(schedules))


def candidates(profile: Profile, devices: int, schedules: Sequence[str] | None = None,
               checkpoints: Sequence[str] = CHECKPOINTS, max_microbatches: int = 32,
               bytes_per_param: float = 16.0) -> list[Scored]:
    """Every plan the search considers, with its per-stage peak memory (nothing simulated yet).

    Raises:
        ValueError: ``devices`` < 1, an unknown schedule or checkpoint mode.
    """
    if devices < 1:
        raise ValueError(f"devices: must be >= 1, got {devices}")
    allowed = _check_schedules(list(schedules or DEFAULT_SCHEDULES))
    bad = [c for c in checkpoints if c not in CHECKPOINTS]
    if bad or not checkpoints:
        raise ValueError(f"checkpoints: {list(checkpoints)} must be a non-empty list of {list(CHECKPOINTS)}")
    cost, batch = profile.cost_model(), profile.batch
    memory = StageMemoryModel(profile.memory, bytes_per_param, profile.fixed_bytes)
    out: list[Scored] = []
    cuts: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for k in range(1, min(devices, profile.num_layers) + 1):
        for m in [m for m in microbatch_counts(batch, max_microbatches) if batch // m in profile.micro_sizes]:
            for schedule in allowed:
                for v in _virtual_stages(schedule, k, profile.num_layers, allowed):
                    try:
                        plan = get_schedule(schedule, k, m, v)
                    except ValueError:  # a form that cannot run this M (interleaved 1F1B: K=5, M=32)
                        continue
                    if (k * v, m) not in cuts:
                        cuts[(k * v, m)] = _balances(profile, cost, memory, k * v, batch // m)
                    for balance in cuts[(k * v, m)]:
                        sets: set[frozenset[int]] = set()
                        for checkpoint in checkpoints:
                            same = checkpointed_microbatches(checkpoint, m)
                            if same not in sets:  # else e.g. except_last at M=1, which is never
                                sets.add(same)
                                out.append(Scored(Candidate(balance, m, schedule, checkpoint, v),
                                                  memory.stage_peaks(plan, balance, m, batch, checkpoint)))
    return out


def _virtual_stages(schedule: str, k: int, layers: int, allowed: Sequence[str]) -> list[int]:
    """The virtual stages per device searched for ``schedule`` on ``k`` devices: ``VIRTUAL_STAGES`` that
    fit the layers for a schedule with a virtual form (and 1 unless that is ``1f1b``, also allowed)."""
    if schedule != "interleaved-1f1b":
        return [1]
    own = [v for v in VIRTUAL_STAGES if k >= 2 and k * v <= layers]
    return own if "1f1b" in allowed else [1, *own]


def plan_auto(profile: Profile, budget_bytes: float, devices: int, schedules: Sequence[str] | None = None,
              checkpoints: Sequence[str] = CHECKPOINTS, max_microbatches: int = 32,
              bytes_per_param: float = 16.0, runners_up: int = 5) -> PlanResult:
    """Search the plans of ``profile``'s model and mini-batch (see the module docstring).

    Raises:
        NoPlanFits: no candidate fits ``budget_bytes`` on every stage; one line naming the smallest
            memory that would fit and the plan it would use.
        ValueError: ``devices`` < 1, an unknown schedule or checkpoint mode.
    """
    began = time.perf_counter()
    every = candidates(profile, devices, schedules, checkpoints, max_microbatches, bytes_per_param)
    fitting = [s for s in every if s.peak_bytes <= budget_bytes]
    over = [s for s in every if s.peak_bytes > budget_bytes]
    cost, batch = profile.cost_model(), profile.batch
    if not fitting:
        raise _no_fit(over, cost, budget_bytes, batch, profile.split_backward)
    simulated = _rank(fitting, cost, batch, runners_up + 1, list(schedules or DEFAULT_SCHEDULES),
                      profile.split_backward)
    chosen = fitting[0]
    chosen.reason = "chosen: fastest predicted step that fits"
    result = PlanResult(chosen, _runners_up(chosen, fitting[1:simulated], over, budget_bytes, runners_up),
                        int(budget_bytes), batch, devices, len(every), len(fitting), simulated, 0.0)
    result.seconds = time.perf_counter() - began
    return result


def _predict(s: Scored, cost: CostModel, batch: int, split: Sequence[tuple[float, float]] | None) -> None:
    c = s.candidate
    pred = cost.predict(list(c.balance), c.microbatches, batch, c.schedule, c.checkpoint, split, c.virtual_stages)
    s.step_time, s.bubble = pred.step_time, pred.bubble


def _bound(c: Candidate, cost: CostModel, batch: int, split: Sequence[tuple[float, float]] | None) -> float:
    """A lower bound of ``c``'s predicted step, without simulating: its busiest device's actions end to
    end, and one micro-batch's forward and backward through every stage (the cost model's own costs;
    a split backward's B + W at the least they may cost)."""
    m, samples = c.microbatches, batch / c.microbatches
    grad, nograd, back, again = (cost.stage_seconds(kind, list(c.balance), samples)
                                 for kind in ("forward_grad", "forward_nograd", "backward", "recompute"))
    replayed = len(checkpointed_microbatches(c.checkpoint, m))
    split_here = bool(split) and c.schedule in SPLIT_BACKWARD
    both = min(1.0, min(b + w for b, w in split)) if split_here else 1.0  # B + W of a micro-batch
    only_b = min(1.0, min(b for b, _ in split)) if split_here else 1.0  # B alone: the backward's path
    stage = [(m - replayed) * g + replayed * (n + a) + m * b * both
             for g, n, b, a in zip(grad, nograd, back, again)]
    k = c.partitions
    busiest = max(sum(stage[s] for s in range(d, len(stage), k)) for d in range(k))
    path = sum(min(g, n) for g, n in zip(grad, nograd)) + only_b * sum(back)
    return max(busiest, path)


def _rank(fitting: list[Scored], cost: CostModel, batch: int, top: int, schedules: list[str],
          split: Sequence[tuple[float, float]] | None) -> int:
    """Sort ``fitting`` so that its first ``top`` are the fastest by the full (contended) prediction;
    returns how many were fully simulated (the sorted prefix).

    Two lower bounds keep the simulations few: ``_bound`` (no device finishes before its own actions, no
    micro-batch before its path through every stage) and the prediction with stages alone (stages only
    slow each other). Plans are fully simulated in the order of their stages-alone predictions, each
    simulated alone only once its cheap bound is the lowest left, until no bound can beat the
    ``top``-th best found. Within ``TIE`` of the fastest (a tie), the smaller peak memory wins, then the
    simpler schedule and less re-materialization.
    """
    bounds = {id(s): _bound(s.candidate, cost, batch, split) for s in fitting}
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
            _predict(order[i], alone_cost, batch, split)
            heapq.heappush(alone, (order[i].step_time or 0.0, i, order[i]))
            i += 1
        if not alone or alone[0][0] > limit:
            break
        s = heapq.heappop(alone)[2]
        if cost.contended is not None and s.candidate.partitions > 1:
            _predict(s, cost, batch, split)
        done.append(s)
    fastest = min(x.step_time or 0.0 for x in done)

    def key(s: Scored) -> tuple:
        c = s.candidate
        tied = (s.step_time or 0.0) <= fastest * (1 + TIE)
        return (not tied, 0.0 if tied else s.step_time, s.peak_bytes, schedules.index(c.schedule),
                CHECKPOINTS.index(c.checkpoint))

    done.sort(key=key)
    chosen = {id(x) for x in done}
    fitting[:] = done + [x for x in order if id(x) not in chosen]
    return len(done)


def _over_reason(s: Scored, budget: float) -> str:
    k = max(range(len(s.stage_bytes)), key=lambda i: s.stage_bytes[i])
    return f"over memory on stage {k}: {format_bytes(s.stage_bytes[k])} > {format_bytes(budget)}"


def _runners_up(chosen: Scored, rest: list[Scored], over: list[Scored], budget: float, count: int) -> list[Scored]:
    """The next fastest fitting plans (slower by x%), then the chosen plan's neighbours that do not fit:
    less re-materialization, twice fewer micro-batches, or one stage fewer, each with the same schedule."""
    out: list[Scored] = []
    seen: set[tuple] = set()

    def same(a: Scored, b: Scored) -> bool:  # an equivalent plan (e.g. gpipe-bw at M=1) says nothing new
        return (abs((a.step_time or 0.0) - (b.step_time or 0.0)) <= TIE * (b.step_time or 0.0)
                and abs(a.peak_bytes - b.peak_bytes) <= TIE * b.peak_bytes)

    for s in rest:
        c = s.candidate
        if (c.partitions, c.microbatches, c.schedule, c.checkpoint) in seen or any(same(s, x) for x in [chosen, *out]):
            continue  # the other balance of a listed setting, or an equivalent plan
        seen.add((c.partitions, c.microbatches, c.schedule, c.checkpoint))
        assert s.step_time is not None and chosen.step_time is not None
        s.reason = (f"slower by {s.step_time / chosen.step_time - 1:.1%}" if s.step_time > chosen.step_time * (1 + TIE)
                    else f"as fast (within {TIE:.1%}), more memory: {format_bytes(s.peak_bytes)}")
        out.append(s)
        if len(out) == count:
            break
    c = chosen.candidate
    wanted = [(c.partitions, c.microbatches, _LESS_REMAT.get(c.checkpoint)),
              (c.partitions, c.microbatches // 2, c.checkpoint), (c.partitions - 1, c.microbatches, c.checkpoint)]
    for k, m, mode in wanted:
        match = [s for s in over if (s.candidate.partitions, s.candidate.microbatches, s.candidate.checkpoint)
                 == (k, m, mode) and s.candidate.schedule == c.schedule]
        if match:
            best = min(match, key=lambda s: s.peak_bytes)
            best.reason = _over_reason(best, budget)
            out.append(best)
    return out


def _no_fit(over: list[Scored], cost: CostModel, budget: float, batch: int,
            split: Sequence[tuple[float, float]] | None) -> NoPlanFits:
    """The refusal: the least memory any candidate needs, and the fastest plan at that memory."""
    least = min(s.peak_bytes for s in over)
    tied = [s for s in over if s.peak_bytes <= least * (1 + 1e-9)]
    for s in tied:
        _predict(s, cost, batch, split)
    best = min(tied, key=lambda s: s.step_time or 0.0)
    return NoPlanFits(f"no plan fits {format_bytes(budget)} per device; the smallest memory that fits is "
                      f"{format_bytes(least)} ({int(least)} bytes), with {best.candidate.describe()}", best)

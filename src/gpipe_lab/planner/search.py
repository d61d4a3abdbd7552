"""The planner's search: the fastest pipeline plan that fits a memory budget, its steps in order.

``plan_model`` (what ``gpipe-plan auto``, ``gpipe-train pipeline.plan=auto`` and ``experiments.plan_check``
call) runs them top to bottom:

0. profile (``planner.profile_cache``): the model's per-layer times and bytes, measured once and cached;
1. candidates (``plans``, here): K from 1 to the devices (and the layers), and for ``interleaved-1f1b``
   v virtual stages per device (``VIRTUAL_STAGES``: K·v stages, stage s on device s % K), and for a
   schedule with only a virtual form (``zb-v``, ``dualpipev``, a registered one) the v it runs with,
   its stages where its placement puts them; M from 1, 2,
   4, ... up to ``max_microbatches``, dividing the mini-batch, at a micro-batch size the profile
   measured (a size the model cannot train on, e.g. BatchNorm over one value, is never planned); each
   balance ``balance_by_cost`` gives for the per-layer time (forward + backward at that micro-batch
   size) and for the per-layer memory; each allowed schedule; each checkpoint mode;
2. memory filter (``planner.memory``): each plan's peak per device; a plan over the budget on any
   device is never simulated;
3. time prediction (``planner.cost_model``): the simulator runs the plan's action lists (the same the
   executor runs) with the profile's costs;
4. rank (``planner.rank``): fastest predicted first (few plans need a full simulation), ties to the
   smaller peak memory, then the simpler schedule; runner-ups with why each lost;
5. trials (``planner.trials``): the fastest predicted few run a few steps each; the fastest measured wins.

``plan_auto`` is steps 1 to 4 on a profile; ``candidates`` steps 1 and 2. The result prints itself
(``PlanResult.describe``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpipe_lab.pipeline import PipelineOptions, balance_by_cost, checkpointed_microbatches
from gpipe_lab.pipeline.schedules import (
    SCHEDULES,
    Schedule,
    get_schedule,
    schedule_names,
    virtual_stage_counts,
)
from gpipe_lab.planner.cost_model import CostModel
from gpipe_lab.planner.memory import StageMemoryModel
from gpipe_lab.planner.plan_types import (
    BYTES_PER_PARAM,
    CHECKPOINTS,
    DEFAULT_SCHEDULES,
    DEFAULT_TRIALS,
    MAX_MICROBATCHES,
    RUNNERS_UP,
    VIRTUAL_STAGES,
    Candidate,
    PlanResult,
    Scored,
)
from gpipe_lab.planner.profile_cache import Profile, load_or_measure
from gpipe_lab.planner.rank import no_fit, rank, runners_up
from gpipe_lab.planner.trials import refine_by_trials
from gpipe_lab.planner.workload import WorkloadSpec

__all__ = ["bytes_per_param_of", "candidates", "default_devices", "microbatch_counts", "plan_auto", "plan_model",
           "plans"]


def plan_model(preset: str, sizes: dict[str, Any], batch: int, budget_bytes: float, devices: int | None = None,
               schedules: Sequence[str] | None = None, checkpoints: Sequence[str] = CHECKPOINTS,
               max_microbatches: int = MAX_MICROBATCHES, bytes_per_param: float = BYTES_PER_PARAM,
               repeat: int = 3, cache: Path | None = None, trials: int = DEFAULT_TRIALS,
               ) -> tuple[PlanResult, Profile, dict[str, Any]]:
    """Profile ``preset`` with ``sizes`` at ``batch`` (from the cache when it was measured before),
    search its plans and run the ``trials`` fastest predicted ones to choose by measurement (0: by
    prediction alone); returns the result, the profile and facts for the report (``cached``,
    ``profile_seconds``, ``profile_key``, ``trial_seconds``). ``devices`` None: ``default_devices()``.

    Raises:
        NoPlanFits: nothing fits ``budget_bytes`` (the message names the smallest memory that does).
        ValueError: bad sizes, devices, schedules, checkpoint modes or a negative ``trials``.
    """
    if trials < 0:
        raise ValueError(f"trials: must be >= 0 (0: choose by prediction alone), got {trials}")
    devices = default_devices() if devices is None else devices
    if devices < 1:
        raise ValueError(f"devices: must be >= 1, got {devices}")
    micro = sorted({batch // m for m in microbatch_counts(batch, max_microbatches)} | {batch})
    if len(micro) < 2:  # one sample: time a second size for the fixed + per-sample fit
        micro.append(2 * micro[0])
    began = time.perf_counter()
    profile, cached = load_or_measure(preset, dict(sizes), batch, micro, contended=devices > 1, repeat=repeat,
                                      directory=cache)
    facts: dict[str, Any] = {"cached": cached, "profile_seconds": time.perf_counter() - began,
                             "profile_key": profile.key}
    result = plan_auto(profile, budget_bytes, devices, schedules, checkpoints, max_microbatches, bytes_per_param)
    began = time.perf_counter()
    result = refine_by_trials(result, WorkloadSpec(preset, preset, dict(sizes), batch), trials,
                              bytes_per_param=bytes_per_param)
    facts["trial_seconds"] = time.perf_counter() - began
    return result, profile, facts


def plan_auto(profile: Profile, budget_bytes: float, devices: int, schedules: Sequence[str] | None = None,
              checkpoints: Sequence[str] = CHECKPOINTS, max_microbatches: int = MAX_MICROBATCHES,
              bytes_per_param: float = BYTES_PER_PARAM, count: int = RUNNERS_UP) -> PlanResult:
    """Steps 1 to 4 (see the module docstring) on ``profile``'s model and mini-batch; ``count``
    runner-ups that fit are listed.

    Raises:
        NoPlanFits: no candidate fits ``budget_bytes`` on every device; one line naming the smallest
            memory that would fit and the plan it would use.
        ValueError: ``devices`` < 1, an unknown schedule or checkpoint mode.
    """
    began = time.perf_counter()
    every = candidates(profile, devices, schedules, checkpoints, max_microbatches, bytes_per_param)
    fitting = [s for s in every if s.peak_bytes <= budget_bytes]
    over = [s for s in every if s.peak_bytes > budget_bytes]
    cost, batch = profile.cost_model(), profile.batch
    if not fitting:
        raise no_fit(over, cost, budget_bytes, batch, profile.split_backward)
    simulated = rank(fitting, cost, batch, count + 1, _checked_schedules(schedules), profile.split_backward)
    chosen = fitting[0]
    chosen.reason = "chosen: fastest predicted step that fits"
    result = PlanResult(chosen, runners_up(chosen, fitting[1:simulated], over, budget_bytes, count),
                        int(budget_bytes), batch, devices, len(every), len(fitting), simulated, 0.0)
    result.seconds = time.perf_counter() - began
    return result


def candidates(profile: Profile, devices: int, schedules: Sequence[str] | None = None,
               checkpoints: Sequence[str] = CHECKPOINTS, max_microbatches: int = MAX_MICROBATCHES,
               bytes_per_param: float = BYTES_PER_PARAM) -> list[Scored]:
    """Steps 1 and 2: every plan the search considers, with its peak memory per device (nothing
    simulated yet).

    Raises:
        ValueError: ``devices`` < 1, an unknown schedule or checkpoint mode.
    """
    memory = StageMemoryModel(profile.memory, bytes_per_param, profile.fixed_bytes)
    every = plans(profile, memory, devices, schedules, checkpoints, max_microbatches)
    forms: dict[tuple[str, int, int, int], Schedule] = {}
    out = []
    for c in every:
        o = c.options
        assert o.partitions is not None and o.balance is not None  # ``plans`` sets both
        form = (o.schedule, o.partitions, o.chunks, o.virtual_stages)
        if form not in forms:
            forms[form] = get_schedule(*form)
        out.append(Scored(c, memory.stage_peaks(forms[form], o.balance, o.chunks, profile.batch, o.checkpoint)))
    return out


def plans(profile: Profile, memory: StageMemoryModel, devices: int, schedules: Sequence[str] | None = None,
          checkpoints: Sequence[str] = CHECKPOINTS, max_microbatches: int = MAX_MICROBATCHES) -> list[Candidate]:
    """Step 1: every plan of the search (see the module docstring); ``memory`` gives the per-layer
    memory the memory-balanced cut follows.

    Raises:
        ValueError: ``devices`` < 1, an unknown schedule or checkpoint mode.
    """
    if devices < 1:
        raise ValueError(f"devices: must be >= 1, got {devices}")
    allowed = _checked_schedules(schedules)
    bad = [c for c in checkpoints if c not in CHECKPOINTS]
    if bad or not checkpoints:
        raise ValueError(f"checkpoints: {list(checkpoints)} must be a non-empty list of {list(CHECKPOINTS)}")
    cost, batch = profile.cost_model(), profile.batch
    out: list[Candidate] = []
    cuts: dict[tuple[int, int], list[list[int]]] = {}
    for k in range(1, min(devices, profile.num_layers) + 1):
        for m in [m for m in microbatch_counts(batch, max_microbatches) if batch // m in profile.micro_sizes]:
            for schedule in allowed:
                for v in _virtual_stages(schedule, k, profile.num_layers, allowed):
                    try:
                        get_schedule(schedule, k, m, v)
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
                                out.append(Candidate(PipelineOptions(
                                    partitions=k, balance=list(balance), chunks=m, schedule=schedule,
                                    checkpoint=checkpoint, virtual_stages=v)))
    return out


def microbatch_counts(batch: int, max_microbatches: int) -> list[int]:
    """1, 2, 4, ... up to ``max_microbatches`` and ``batch``, each dividing ``batch``."""
    out, m = [], 1
    while m <= min(batch, max_microbatches):
        if batch % m == 0:
            out.append(m)
        m *= 2
    return out


def _checked_schedules(schedules: Sequence[str] | None) -> list[str]:
    """``schedules`` (None or empty: ``DEFAULT_SCHEDULES``) without repeats.

    Raises:
        ValueError: an empty list or an unknown schedule.
    """
    names = list(schedules or DEFAULT_SCHEDULES)
    unknown = [s for s in names if s not in schedule_names()]
    if unknown or not names:
        raise ValueError(f"schedules: {names} must be a non-empty list of {schedule_names()}")
    return list(dict.fromkeys(names))


def _virtual_stages(schedule: str, k: int, layers: int, allowed: Sequence[str]) -> list[int]:
    """The virtual stages per device searched for ``schedule`` on ``k`` devices: 1 for a schedule with
    a one-stage-per-rank form, and the v > 1 its virtual form runs with (``VIRTUAL_STAGES`` when any)
    that fit the layers. ``gpipe`` and ``1f1b`` search their virtual forms as ``interleaved-1f1b``,
    whose v = 1 is ``1f1b`` (searched once, under ``1f1b`` when that is also allowed)."""
    if schedule in ("gpipe", "1f1b"):
        return [1]
    counts = virtual_stage_counts(schedule)
    own = [v for v in (VIRTUAL_STAGES if counts is None else counts) if k >= 2 and k * v <= layers]
    if schedule == "interleaved-1f1b" and "1f1b" in allowed:
        return own
    return ([1] if schedule in SCHEDULES else []) + own


def _balances(profile: Profile, cost: CostModel, memory: StageMemoryModel, k: int, micro: int) -> list[list[int]]:
    """The time-balanced and the memory-balanced cut into ``k`` stages (one if they agree)."""
    if k == 1:
        return [[profile.num_layers]]
    seconds = [a + b for a, b in zip(*(cost.stage_seconds(kind, [1] * profile.num_layers, micro)
                                       for kind in ("forward_grad", "backward")))]
    out = [list(balance_by_cost(seconds, k))]
    by_memory = list(balance_by_cost(memory.layer_weights(micro), k))
    if by_memory not in out:
        out.append(by_memory)
    return out


def default_devices() -> int:
    """Stages this machine can run side by side: its GPUs, else its CPU cores (one thread per stage)."""
    import torch

    return torch.cuda.device_count() or os.cpu_count() or 1


def bytes_per_param_of(optimizer: str | None, momentum: float | None = None) -> float:
    """Parameter state bytes per float32 parameter: weights and gradients (8), plus the optimizer's
    slots: Adam / AdamW two (``BYTES_PER_PARAM``, 16), SGD one with momentum (12), none without (8).

    Raises:
        ValueError: an optimizer name other than sgd, adam, adamw.
    """
    if optimizer in ("adam", "adamw"):
        return BYTES_PER_PARAM
    if optimizer == "sgd":
        return 12.0 if momentum else 8.0
    raise ValueError(f"optimizer {optimizer!r}: the planner knows sgd, adam and adamw")

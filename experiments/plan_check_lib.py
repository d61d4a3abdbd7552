"""``plan_check``'s measuring: a workload's grid run and timed, each budget's row, and the emulated devices.

Real CPU stages (``check_workload``): a fresh profile, the planner's choice at a loose and a tight
budget, alone and with measured trials, then every plan of the grid timed by ``GPipe``.

Emulated devices (``check_emulated``): the same network with each layer sleeping its share of a
set forward time (``bench.EmulatedSpec``: FLOPs-proportional, backward twice the forward), so that
up to ``EMULATED_DEVICES`` stages run side by side on two cores. Their per-layer costs are known by
construction, but a sleep overshoots and each call costs its own overhead, so the emulated layers
are timed as the planner times any model (no contention: a sleeping device leaves the CPU to the
others), with the engine's per-action overhead and hand-over measured for the real network's
profile; the planner then searches K up to 8 and the grid is timed as for real stages.
Emulated layers hold no real activations, so these rows judge speed only, at the loose budget (the
real network's memory model prunes nothing there), and only the schedules without a split backward
(an emulated layer has no separate weight-gradient pass to defer).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from gpipe_lab.bench import EmulatedSpec, Progress
from gpipe_lab.planner.layer_timing import layer_times
from gpipe_lab.planner.plan_types import DEFAULT_TRIALS, Candidate, PlanResult, Scored
from gpipe_lab.planner.profile_cache import Profile
from gpipe_lab.planner.search import candidates, plan_auto, plan_model
from gpipe_lab.planner.trials import measure_plan, refine_by_trials
from gpipe_lab.planner.workload import WorkloadSpec

BYTES_PER_PARAM = 16.0  # Adam: weights, gradients and two slots in float32
DEVICES = 2  # this machine's cores: one thread per CPU stage
EMULATED_DEVICES = 8
EMULATED_FORWARD_MS = 10.0  # the mini-batch forward on emulated devices (backward: twice that)
EMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")

Spec = WorkloadSpec | EmulatedSpec


def screened(spec: Spec, grid: list[Scored], budgets: list[float], chosen: list[Candidate], steps: int,
             top: int, progress: Progress) -> list[dict[str, Any]]:
    """Every plan timed for one step, then the finalists (the ``top`` fastest fitting each budget and the
    ``chosen`` ones) for ``steps`` more, one step each per round (each after a warm-up); a plan's step
    time is the fastest of its timed steps (other work on a shared machine only slows a step). The best
    measured plan of a budget is the fastest finalist that fits it (one step against four would favour
    a plan that was lucky once)."""
    measured = []
    for s in grid:
        times, memory = measure_plan(spec, s.candidate, 1, BYTES_PER_PARAM)  # type: ignore[arg-type]
        measured.append({"plan": s.candidate, "times": times, "stage_bytes": memory,
                         "predicted_stage_bytes": s.stage_bytes})
        progress.done(s.candidate.describe())
    again = {id(m) for m in measured if m["plan"] in chosen}
    for budget in budgets:
        fits = sorted((m for m in measured if max(m["stage_bytes"]) <= budget), key=lambda m: m["times"][0])
        again |= {id(m) for m in fits[:top]}
    finalists = [m for m in measured if id(m) in again]
    for m in measured:
        m["finalist"] = id(m) in again
    for _ in range(steps):  # round-robin: a burst of other work on the machine hits every finalist alike
        for m in finalists:
            m["times"] += measure_plan(spec, m["plan"], 1, BYTES_PER_PARAM)[0]  # type: ignore[arg-type]
    for m in finalists:
        progress.done(f"again: {m['plan'].describe()}")
    for m in measured:
        m["step_s"] = min(m["times"])
    return measured


def predictions(profile: Profile, grid: list[Scored], batch: int) -> dict[Candidate, float]:
    """The cost model's step for every plan of the grid (as the search predicts it)."""
    cost = profile.cost_model()
    return {s.candidate: cost.predict_options(s.candidate.options, batch, profile.split_backward).step_time
            for s in grid}


def row(label: str, name: str, budget: float, result: PlanResult, refined: PlanResult,
        measured: list[dict[str, Any]], grid: list[Scored], predicted: dict[Candidate, float],
        memory_measured: bool = True) -> dict[str, Any]:
    """One budget's row: both choices against the best measured plan that fits, and the best plan's
    rank in the predicted order (how many trials would reach it)."""
    mine = next(m for m in measured if m["plan"] == result.chosen.candidate)
    tried = next(m for m in measured if m["plan"] == refined.chosen.candidate)
    fits = [m for m in measured if max(m["stage_bytes"]) <= budget] if memory_measured else measured
    best = min((m for m in fits if m["finalist"]), key=lambda m: m["step_s"])
    order = sorted((s for s in grid if s.peak_bytes <= budget), key=lambda s: predicted[s.candidate])
    rank = next((1 + i for i, s in enumerate(order) if s.candidate == best["plan"]), None)  # None: predicted over
    peak = (lambda m: max(m["stage_bytes"])) if memory_measured else (lambda m: None)
    return {"workload": label, "budget": name, "budget_bytes": int(budget), "memory_measured": memory_measured,
            "chosen": result.chosen.candidate.describe(), "predicted_step_s": result.chosen.step_time,
            "chosen_step_s": mine["step_s"], "best": best["plan"].describe(), "best_step_s": best["step_s"],
            "ratio": best["step_s"] / mine["step_s"], "chosen_peak_bytes": peak(mine),
            "predicted_peak_bytes": result.chosen.peak_bytes, "plans_fitting": len(fits),
            "trials": refined.trials, "trial_chosen": refined.chosen.candidate.describe(),
            "trial_chosen_step_s": tried["step_s"], "trial_ratio": best["step_s"] / tried["step_s"],
            "trial_chosen_peak_bytes": peak(tried), "best_predicted_rank": rank,
            "plans_predicted_to_fit": len(order), "best_predicted_step_s": predicted[best["plan"]],
            "trialled": [r.to_dict() for r in [refined.chosen, *refined.runners_up] if r.measured_step is not None],
            "search_seconds": result.seconds}


def grid_rows(measured: list[dict[str, Any]], predicted: dict[Candidate, float]) -> list[dict[str, Any]]:
    return [{**m, "plan": m["plan"].describe(), "times": [round(t, 6) for t in m["times"]],
             "predicted_step_s": predicted[m["plan"]]} for m in measured]


def check_workload(label: str, spec: WorkloadSpec, schedules: list[str], max_m: int, steps: int, repeat: int,
                   top: int, progress_note: str, trials: int = DEFAULT_TRIALS,
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Profile]:
    """The rows (one per budget), the measured grid and the profile of one workload on real CPU stages."""
    with tempfile.TemporaryDirectory() as cache:  # measured now, at the moment the grid is
        _, profile, facts = plan_model(spec.preset, spec.sizes, spec.batch, 2**50, DEVICES, schedules,
                                       max_microbatches=max_m, bytes_per_param=BYTES_PER_PARAM,
                                       repeat=repeat, cache=Path(cache), trials=0)
    grid = candidates(profile, DEVICES, schedules, max_microbatches=max_m, bytes_per_param=BYTES_PER_PARAM)
    predicted = predictions(profile, grid, spec.batch)
    loose = float(max(s.peak_bytes for s in grid))
    least = float(min(s.peak_bytes for s in grid))
    chosen_loose = plan_auto(profile, loose, DEVICES, schedules, max_microbatches=max_m,
                             bytes_per_param=BYTES_PER_PARAM)
    budgets = {"loose": loose, "tight": (least + chosen_loose.chosen.peak_bytes) / 2}
    chosen = {name: plan_auto(profile, budget, DEVICES, schedules, max_microbatches=max_m,
                              bytes_per_param=BYTES_PER_PARAM) for name, budget in budgets.items()}
    trialled = {name: refine_by_trials(result, spec, trials, bytes_per_param=BYTES_PER_PARAM)
                for name, result in chosen.items()}  # what plan=auto runs by default
    picks = [r.chosen.candidate for r in [*chosen.values(), *trialled.values()]]
    progress = Progress(len(grid) + top * len(budgets) + len(picks), f"plan_check {label}", note=progress_note)
    measured = screened(spec, grid, list(budgets.values()), picks, steps, top, progress)
    rows = [{**row(label, name, budget, chosen[name], trialled[name], measured, grid, predicted),
             "profile_seconds": facts["profile_seconds"]} for name, budget in budgets.items()]
    return rows, grid_rows(measured, predicted), profile


def emulated_profile(em: EmulatedSpec, real: Profile, repeat: int) -> Profile:
    """The profile of ``em``'s emulated network: its layers timed (``layer_timing.layer_times``: a sleep
    overshoots its set time, and each call has its own overhead) at every size ``real`` timed, no
    contention between devices, ``real``'s engine overhead, hand-over and memory records (see the
    module docstring)."""
    alone = {n: layer_times(em, n, repeat) for n in real.micro_sizes}  # type: ignore[arg-type]
    return Profile(f"emulated-{real.key}", real.preset, dict(real.sizes), real.batch, alone, None, real.overhead,
                   real.hop, list(real.memory), list(real.fixed_bytes), real.split_backward)


def check_emulated(label: str, spec: WorkloadSpec, real: Profile, max_m: int, steps: int, repeat: int, top: int,
                   progress_note: str, devices: int = EMULATED_DEVICES, forward_ms: float = EMULATED_FORWARD_MS,
                   schedules: tuple[str, ...] = EMULATED_SCHEDULES, trials: int = DEFAULT_TRIALS,
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The row (loose budget) and the measured grid of ``spec``'s network on emulated devices."""
    em = EmulatedSpec(spec, forward_ms)
    profile = emulated_profile(em, real, repeat)
    grid = candidates(profile, devices, schedules, max_microbatches=max_m, bytes_per_param=BYTES_PER_PARAM)
    predicted = predictions(profile, grid, spec.batch)
    loose = float(max(s.peak_bytes for s in grid))
    result = plan_auto(profile, loose, devices, schedules, max_microbatches=max_m, bytes_per_param=BYTES_PER_PARAM)
    refined = refine_by_trials(result, em, trials, bytes_per_param=BYTES_PER_PARAM)  # type: ignore[arg-type]
    picks = [result.chosen.candidate, refined.chosen.candidate]
    progress = Progress(len(grid) + top + len(picks), f"plan_check {label} emulated", note=progress_note)
    measured = screened(em, grid, [float("inf")], picks, steps, top, progress)
    name = f"loose, emulated devices (K <= {devices}, forward {forward_ms:g} ms)"
    return ([row(f"{label} (emulated)", name, loose, result, refined, measured, grid, predicted,
                 memory_measured=False)], grid_rows(measured, predicted))

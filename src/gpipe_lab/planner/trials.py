"""Measured trials: run the planner's fastest predicted plans for a few steps and keep the fastest measured.

The cost model ranks hundreds of plans in milliseconds, but plans a few percent apart are
inside its error (on CPU stages the threads' contention above all). ``refine_by_trials``
therefore takes the chosen plan and the next ``trials - 1`` fastest predicted plans that fit,
runs each with ``GPipe`` on the planned model and mini-batch (``measure_plan``: one warm-up,
then one timed step per round, the rounds interleaved so that a burst of other work on the
machine hits every plan alike), and chooses the fastest measured plan whose measured
memory fits the budget. Each trialled plan keeps its prediction beside its measurement.

    result = refine_by_trials(plan_auto(profile, budget, devices), spec, trials=3)

This is the search's last step (``planner.search``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.call_timing import time_call
from gpipe_lab.planner.memory import format_bytes
from gpipe_lab.planner.plan_types import BYTES_PER_PARAM, DEFAULT_TRIALS, Candidate, PlanResult
from gpipe_lab.planner.workload import WorkloadSpec

__all__ = ["Measure", "measure_plan", "per_device", "refine_by_trials"]

#: ``(spec, plan, steps, bytes_per_param)`` -> (seconds of each timed step, memory of each stage)
Measure = Callable[[WorkloadSpec, Candidate, int, float], tuple[list[float], list[float]]]


def measure_plan(spec: WorkloadSpec, c: Candidate, steps: int, bytes_per_param: float = BYTES_PER_PARAM,
                 ) -> tuple[list[float], list[float]]:
    """Seconds of each of ``steps`` timed ``GPipe`` training steps of plan ``c`` (after one warm-up),
    and each stage's memory as the planner counts it: parameter state (parameters x
    ``bytes_per_param``) plus the engine's tracked peak saved activations. CPU stages, one thread each.
    """
    built = spec.build(1)
    pipe = GPipe(built.module, options=c.options.replace(threads_per_stage=1, seed=0))
    timing = time_call(lambda: pipe.train_step(built.inputs, built.targets, built.loss_fn), steps, warmup=1,
                       between=lambda: built.module.zero_grad(set_to_none=True))
    return list(timing.times), per_device(pipe.memory(), c.options.num_stages, bytes_per_param)


def per_device(rows: list[dict[str, int]], devices: int, bytes_per_param: float = BYTES_PER_PARAM) -> list[float]:
    """Each device's memory as the planner counts it, from the engine's per-stage ``memory()`` rows
    (stage s on device ``s % devices``): parameter state (parameters x ``bytes_per_param``, from the
    float32 parameter bytes) plus peak saved activations, summed over the device's stages."""
    stage = [r["parameter_bytes"] / 4 * bytes_per_param + r["peak_activation_bytes"] for r in rows]
    return [sum(stage[s] for s in range(k, len(stage), devices)) for k in range(devices)]


def refine_by_trials(result: PlanResult, spec: WorkloadSpec, trials: int = DEFAULT_TRIALS, rounds: int = 2,
                     bytes_per_param: float = BYTES_PER_PARAM, measure: Measure = measure_plan) -> PlanResult:
    """``result`` with its choice made by measurement among its ``trials`` fastest predicted plans that
    fit (see the module docstring); ``trials`` 0 returns ``result`` as it is.

    A trialled plan's step is the fastest of its ``rounds`` timed steps. A plan whose measured memory
    exceeds the budget on some stage is not chosen (its reason says so); if every trial does, the
    predicted choice stays and a note says so.

    Raises:
        ValueError: ``trials`` or ``rounds`` below their minimum (0 and 1).
    """
    if trials < 0 or rounds < 1:
        raise ValueError(f"trials must be >= 0 and rounds >= 1, got trials={trials}, rounds={rounds}")
    if trials == 0:
        return result
    budget = result.budget_bytes
    fitting = [r for r in result.runners_up if r.step_time is not None and r.peak_bytes <= budget]
    pool = [result.chosen, *fitting][:trials]
    times: list[list[float]] = [[] for _ in pool]
    memory: list[list[float]] = [[] for _ in pool]
    for _ in range(rounds):  # interleaved: other work on the machine slows every plan alike
        for i, s in enumerate(pool):
            seconds, stage_bytes = measure(spec, s.candidate, 1, bytes_per_param)
            times[i] += seconds
            memory[i] = [max(a, b) for a, b in zip(memory[i], stage_bytes)] if memory[i] else list(stage_bytes)
    tried = [dataclasses.replace(s, measured_step=min(t), measured_stage_bytes=m)
             for s, t, m in zip(pool, times, memory)]
    fits = [s for s in tried if max(s.measured_stage_bytes or [0.0]) <= budget]
    notes = list(result.notes)
    if fits:
        chosen = min(fits, key=lambda s: s.measured_step or 0.0)
        chosen.reason = f"chosen: fastest measured of {len(tried)} trials"
    else:
        chosen = tried[0]
        chosen.reason = "chosen: fastest predicted (every trial measured over the budget)"
        notes.append(f"every one of {len(tried)} trials measured over {format_bytes(budget)} on some stage")
    best = chosen.measured_step or 0.0
    for s in tried:
        if s is chosen:
            continue
        measured = s.measured_stage_bytes or []
        k = max(range(len(measured)), key=lambda i: measured[i]) if measured else 0
        s.reason = (f"over memory in its trial on stage {k}: {format_bytes(measured[k])} > {format_bytes(budget)}"
                    if measured and measured[k] > budget
                    else f"measured slower by {(s.measured_step or 0.0) / best - 1:.1%} in its trial")
    untried = [r if r.peak_bytes > budget else
               dataclasses.replace(r, reason=f"not trialled; predicted against the first choice: {r.reason}")
               for r in result.runners_up if all(r.candidate != s.candidate for s in tried)]
    notes.append(f"{len(tried)} plans trialled, {rounds} timed steps each; chosen by measurement")
    return dataclasses.replace(result, chosen=chosen, runners_up=[s for s in tried if s is not chosen] + untried,
                               notes=notes, trials=len(tried))

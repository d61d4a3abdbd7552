"""Planning one model end to end: its profile (cached), the search, and the plan as text.

``plan_model`` is what ``gpipe-plan auto``, ``gpipe-train pipeline.plan=auto`` and
``experiments.plan_check`` call; ``format_result`` is the text all of them print.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpipe_lab.bench import WorkloadSpec
from gpipe_lab.planner.auto import CHECKPOINTS, PlanResult, Scored, microbatch_counts, plan_auto
from gpipe_lab.planner.memory_size import format_bytes
from gpipe_lab.planner.profile_cache import Profile, load_or_measure
from gpipe_lab.planner.trials import DEFAULT_TRIALS, refine_by_trials

__all__ = ["bytes_per_param_of", "default_devices", "format_result", "plan_model"]


def default_devices() -> int:
    """Stages this machine can run side by side: its GPUs, else its CPU cores (one thread per stage)."""
    import torch

    return torch.cuda.device_count() or os.cpu_count() or 1


def bytes_per_param_of(optimizer: str | None, momentum: float | None = None) -> float:
    """Parameter state bytes per float32 parameter: weights and gradients (8), plus the optimizer's
    slots: Adam / AdamW two (16), SGD one with momentum (12), none without (8).

    Raises:
        ValueError: an optimizer name other than sgd, adam, adamw.
    """
    if optimizer in ("adam", "adamw"):
        return 16.0
    if optimizer == "sgd":
        return 12.0 if momentum else 8.0
    raise ValueError(f"optimizer {optimizer!r}: the planner knows sgd, adam and adamw")


def plan_model(preset: str, sizes: dict[str, Any], batch: int, budget_bytes: float, devices: int | None = None,
               schedules: Sequence[str] | None = None, checkpoints: Sequence[str] = CHECKPOINTS,
               max_microbatches: int = 32, bytes_per_param: float = 16.0, repeat: int = 3,
               cache: Path | None = None, trials: int = DEFAULT_TRIALS,
               ) -> tuple[PlanResult, Profile, dict[str, Any]]:
    """Profile ``preset`` with ``sizes`` at ``batch`` (from the cache when it was measured before),
    search its plans and run the ``trials`` fastest predicted ones to choose by measurement
    (``planner.trials``; 0: by prediction alone); returns the result, the profile and facts for the
    report (``cached``, ``profile_seconds``, ``trial_seconds``).

    Raises:
        NoPlanFits: nothing fits ``budget_bytes`` (the message names the smallest memory that does).
        ValueError: bad sizes, devices, schedules, checkpoint modes or a negative ``trials``.
    """
    if trials < 0:
        raise ValueError(f"trials: must be >= 0 (0: choose by prediction alone), got {trials}")
    devices = default_devices() if devices is None else devices
    if devices < 1:
        raise ValueError(f"devices: must be >= 1, got {devices}")
    counts = microbatch_counts(batch, max_microbatches)
    micro = sorted({batch // m for m in counts} | {batch})
    if len(micro) < 2:  # one sample: time a second size for the fixed + per-sample fit
        micro.append(2 * micro[0])
    began = time.perf_counter()
    profile, cached = load_or_measure(preset, dict(sizes), batch, micro, contended=devices > 1, repeat=repeat,
                                      directory=cache)
    facts = {"cached": cached, "profile_seconds": time.perf_counter() - began, "profile_key": profile.key}
    result = plan_auto(profile, budget_bytes, devices, schedules, checkpoints, max_microbatches, bytes_per_param)
    began = time.perf_counter()
    result = refine_by_trials(result, WorkloadSpec(preset, preset, dict(sizes), batch), trials,
                              bytes_per_param=bytes_per_param)
    facts["trial_seconds"] = time.perf_counter() - began
    return result, profile, facts


def _measured(s: Scored) -> str:
    return "" if s.measured_step is None else f", measured {s.measured_step * 1e3:.1f} ms in trial"


def format_result(result: PlanResult, title: str, facts: dict[str, Any] | None = None) -> str:
    """The plan as printed: the chosen plan, its predicted step, bubble and memory per stage, and the
    runner-ups with the reason each lost."""
    c, chosen = result.chosen.candidate, result.chosen
    assert chosen.step_time is not None and chosen.bubble is not None
    facts = facts or {}
    profile = ("profile from the cache" if facts.get("cached")
               else f"profile measured in {facts.get('profile_seconds', 0.0):.1f} s")
    if result.trials:
        profile += f"; {result.trials} plans trialled in {facts.get('trial_seconds', 0.0):.1f} s"
    lines = [f"{title}: batch {result.batch}, {result.devices} devices, {format_bytes(result.budget_bytes)} per "
             f"device ({profile}; search: {result.considered} plans, {result.fitting} fit, {result.simulated} "
             f"simulated in full, {result.seconds:.2f} s)",
             f"chosen: {c.describe()}" + (f" ({chosen.reason.removeprefix('chosen: ')})" if result.trials else ""),
             f"  predicted step {chosen.step_time * 1e3:.1f} ms ({result.samples_per_s:,.0f} samples/s), "
             f"bubble {chosen.bubble:.3f}" + _measured(chosen),
             "  stage  peak memory  (budget " + format_bytes(result.budget_bytes) + ")"]
    lines += [f"  {k:>5}  {format_bytes(b):>11}" for k, b in enumerate(chosen.stage_bytes)]
    lines.append("runner-ups:")
    for r in result.runners_up:
        step = f"{r.step_time * 1e3:.1f} ms" if r.step_time is not None else "not simulated"
        lines.append(f"  {r.candidate.describe()}  [{step}{_measured(r)}, peak {format_bytes(r.peak_bytes)}]: "
                     f"{r.reason}")
    if not result.runners_up:
        lines.append("  (none: no other plan fits)")
    return "\n".join(lines)

"""The lab's performance targets (speed-up, bubble, overhead, memory, vs torch), checked against one run (K=2).

Each target yields a row ``{name, value, goal, status}`` with status PASS,
MISS or N/A (the run did not measure it, e.g. ``--smoke`` sizes or a failed case).
"""

from __future__ import annotations

from collections.abc import Iterator

from benchmarks.bench_common import BEYOND_TORCH

K = 2


def _row(name: str, value: float | None, goal: str, ok: bool | None, unit: str = "") -> dict[str, object]:
    status = "N/A" if value is None or ok is None else ("PASS" if ok else "MISS")
    return {"name": name, "value": None if value is None else round(value, 4), "unit": unit, "goal": goal,
            "status": status}


def _local(results: dict, m: int, checkpoint: str = "never", schedule: str = "gpipe") -> dict | None:
    rows = results.get("local", {}).get("mlp", {}).get("rows", [])
    return next((r for r in rows if r["M"] == m and r["checkpoint"] == checkpoint
                 and r["schedule"] == schedule), None)


def _gloo(results: dict, framework: str, schedule: str, m: int) -> float | None:
    for r in results.get("gloo", []):
        if (r["workload"], r["framework"], r["schedule"], r["chunks"], r["checkpoint"]) == \
                ("mlp", framework, schedule, m, "never") and not r.get("error"):
            return r["step"]["median"]
    return None


def memory_m(results: dict) -> int | None:
    """The M at which memory targets are read: 8 when measured, else the largest."""
    ms = sorted({r["M"] for r in results.get("memory", {}).get("mlp", {}).get("activations", [])})
    return 8 if 8 in ms else (ms[-1] if ms else None)


def _peaks(results: dict, m: int, schedule: str, checkpoint: str) -> list[dict]:
    rows = results.get("memory", {}).get("mlp", {}).get("activations", [])
    return sorted((r for r in rows if (r["M"], r["schedule"], r["checkpoint"]) == (m, schedule, checkpoint)),
                  key=lambda r: r["stage"])


def evaluate(results: dict) -> list[dict[str, object]]:
    """Every target of the issue as a PASS / MISS / N/A row."""
    return list(_evaluate(results))


def _evaluate(results: dict) -> Iterator[dict[str, object]]:
    r8 = _local(results, 8)
    yield _row("MLP M=8 never: speed-up over 1-thread baseline", r8 and r8["speedup"], ">= 1.6x",
               r8 and r8["speedup"] >= 1.6, "x")
    yield _row("MLP M=8 never: fraction of micro-batch-corrected ideal", r8 and r8["fraction_of_ideal"],
               ">= 0.90", r8 and r8["fraction_of_ideal"] >= 0.9)
    for transport in ("local", "distributed"):
        for schedule, torch_name in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")):
            for m in (8, 16):
                theirs = _gloo(results, "torch", schedule, m)
                if transport == "local":
                    row = _local(results, m, schedule=schedule)
                    ours = row and row["step_s"]
                else:
                    ours = _gloo(results, "ours", schedule, m)
                ratio = theirs / ours if theirs and ours else None
                yield _row(f"MLP M={m} {schedule} ({transport} transport) vs torch {torch_name}", ratio,
                           ">= 1.1x", ratio and ratio >= 1.1, "x")
    measured = {r["schedule"] for r in results.get("local", {}).get("mlp", {}).get("rows", [])}
    measured |= {r["schedule"] for r in results.get("gloo", []) if r["framework"] == "ours"}
    beyond = [s for s in BEYOND_TORCH if s in measured]
    for schedule in beyond:  # only the schedules this run measured (--quick: gpipe-bw)
        row8 = _local(results, 8, schedule=schedule)
        yield _row(f"MLP M=8 never, {schedule}: speed-up over 1-thread baseline", row8 and row8["speedup"],
                   ">= 1.6x", row8 and row8["speedup"] >= 1.6, "x")
    for transport in ("local", "distributed"):
        for m in (8, 16):
            theirs = min((t for t in (_gloo(results, "torch", s, m) for s in ("gpipe", "1f1b")) if t),
                         default=None)
            for schedule in beyond:
                row = _local(results, m, schedule=schedule)
                ours = row and row["step_s"] if transport == "local" else _gloo(results, "ours", schedule, m)
                ratio = theirs / ours if theirs and ours else None
                yield _row(f"MLP M={m} {schedule} ({transport} transport) vs torch's faster of GPipe/1F1B",
                           ratio, ">= 1.1x", ratio and ratio >= 1.1, "x")
    for r in results.get("product", []):
        ratio = r.get("ratio")
        yield _row(f"gpipe-train / raw engine, {r['model']} K={r.get('K', 2)} M={r.get('M', 4)} "
                   f"({r['transport']} transport)", ratio, ">= 0.95", ratio is not None and ratio >= 0.95)
    rows = [r for r in results.get("local", {}).get("mlp", {}).get("rows", [])
            if r["M"] >= 4 and r["checkpoint"] == "never" and r["schedule"] == "gpipe"]
    worst = max(rows, key=lambda r: r["bubble_measured"] - r["bubble_theory"], default=None)
    gap = worst and worst["bubble_measured"] - worst["bubble_theory"]
    yield _row(f"MLP measured bubble - theory, worst M>=4 (M={worst and worst['M']})", gap, "<= +0.05",
               gap is not None and gap <= 0.05)
    always = _local(results, 8, "always")
    over = always["step_s"] / r8["step_s"] - 1 if always and r8 else None
    yield _row("MLP M=8 recompute overhead (always / never - 1)", over, "<= 0.35", over is not None and over <= 0.35)
    yardstick = {r["workload"]: r for r in results.get("yardstick", [])}
    for name, gain_goal in (("mlp", 1.5), ("transformer", 1.3), ("amoebanet", 1.3)):
        row = yardstick.get(name)
        m = row["M"] if row else 4
        over = row and row["overhead"]["K=1"]
        yield _row(f"{name} M={m}: engine K=1 / plain gradient accumulation (overhead)", over, "<= 1.05",
                   over is not None and over <= 1.05)
        gain = row and row["gain"]["K=2"]
        yield _row(f"{name} M={m}: plain gradient accumulation / engine K=2 (gain)", gain, f">= {gain_goal}x",
                   gain is not None and gain >= gain_goal, "x")
        timed = row and row["gain"].get("K=2, time balance")
        yield _row(f"{name} M={m}: the same gain, K=2 cut by measured time (pipeline.cost=time)", timed,
                   f">= {gain_goal}x", timed is not None and timed >= gain_goal, "x")
    for name in ("mlp", "amoebanet"):  # they draw nothing
        row = yardstick.get(name)
        cost = row and row.get("replay_cost", {}).get("K=2")
        yield _row(f"{name} K=2 M={row['M'] if row else 4}: random replay's cost (draws nothing)", cost,
                   "<= 0.02", cost is not None and cost <= 0.02)
    replay = results.get("replay")
    cost = replay and replay["replay_cost"]["K=2"]
    yield _row(f"transformer dropout {replay['dropout'] if replay else 0.1} K=2 M={replay['M'] if replay else 4}: "
               "random replay's cost", cost, "<= 0.10", cost is not None and cost <= 0.10)
    per = results.get("overhead", {}).get("overhead_per_action_us")
    yield _row("scheduling overhead per action", per, "<= 50 us", per is not None and per <= 50, "us")
    m = memory_m(results)
    if m is None:
        yield _row("saved-activation peak (always) vs boundary + one micro-batch model", None, "within 10%", None)
        yield _row("1F1B peak / GPipe peak (never, stage 0)", None, "<= K/M", None)
        return
    ratios = [r["ratio_to_model"] for r in _peaks(results, m, "gpipe", "always")]
    worst_ratio = max(ratios, key=lambda x: abs(x - 1)) if ratios else None
    yield _row(f"M={m} always: saved-activation peak / model, worst stage", worst_ratio, "within 1 +- 0.10",
               worst_ratio is not None and abs(worst_ratio - 1) <= 0.10)
    g = _peaks(results, m, "gpipe", "never")
    f = _peaks(results, m, "1f1b", "never")
    share = f[0]["peak_activation_bytes"] / g[0]["peak_activation_bytes"] if g and f else None
    yield _row(f"M={m} never, stage 0: 1F1B peak / GPipe peak", share, f"<= K/M = {K / m:.3f}",
               share is not None and share <= K / m * (1 + 1e-9))

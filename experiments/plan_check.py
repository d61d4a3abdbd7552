"""Does ``pipeline.plan=auto`` choose well? The planner's choice against every plan of a grid, measured.

    python -m experiments.plan_check                      # results/plan_check.md (--out results)
    python -m experiments.plan_check --tiny --out /tmp/pc

For the Transformer and AmoebaNet analogues the planner (``planner.search.plan_model``: a fresh
profile, then the search) chooses a plan at two budgets per stage: a loose one that every plan fits,
and a tight one halfway between the least memory any plan needs and what the loose choice uses, which
forces re-materialization, more micro-batches or another cut. Then every plan of the grid the planner
searched on this machine (K in {1, 2} real CPU stages, one thread each; M in {1, 2, 4, ..., 32}; both
balances; every schedule the planner searches by default, interleaved-1f1b with 2 and 4 virtual stages per
device; the checkpoint modes) is run by ``GPipe`` and timed (one step after
a warm-up; the fastest that fit each budget, and the chosen plans, for ``--steps`` more, round-robin:
the fastest of all) with its per-stage memory (parameters x 16 bytes, Adam's state, plus the engine's tracked peak
saved activations). Per row: the best measured plan among those whose measured memory fits the
budget, the ratio of the chosen plan's measured throughput to the best's, and whether the chosen plan's
measured memory stayed within the budget. The same networks on emulated devices (``plan_check_lib``)
add a row each with K up to 8. Target: within 10% in every row, never over budget.
"""

from __future__ import annotations

if not __package__:  # started as a file: rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

from typing import Any

from experiments.common import parser, write
from experiments.plan_check_lib import (
    DEVICES,
    EMULATED_DEVICES,
    EMULATED_FORWARD_MS,
    EMULATED_SCHEDULES,
    check_emulated,
    check_workload,
)
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table
from gpipe_lab.planner.memory import format_bytes
from gpipe_lab.planner.plan_types import DEFAULT_SCHEDULES, DEFAULT_TRIALS, VIRTUAL_STAGES
from gpipe_lab.planner.workload import WorkloadSpec

#: label: (preset, sizes, mini-batch, largest M); small analogues of Table 2's workloads that run in seconds
#: here
WORKLOADS: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "transformer": ("transformer_l", {"num_layers": 8, "d_model": 64, "ffn_dim": 256, "num_heads": 4,
                                      "vocab_size": 256, "seq_len": 32, "dropout": 0.0}, 64, 32),
    "amoebanet": ("amoebanet_d", {"num_layers": 6, "num_filters": 16, "image_size": 16, "num_classes": 10}, 64, 32),
}
TINY: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "transformer": ("transformer_tiny", {"num_layers": 2, "d_model": 16, "ffn_dim": 32, "num_heads": 2,
                                         "vocab_size": 32, "seq_len": 4}, 8, 2),
    "amoebanet": ("amoebanet_d_tiny", {"num_filters": 8, "image_size": 8}, 8, 2),
}
#: searched and measured: every schedule the planner searches by default
SCHEDULES = DEFAULT_SCHEDULES


def _rank(r: dict[str, Any]) -> str:
    rank = r["best_predicted_rank"]
    return "predicted over the budget" if rank is None else f"{rank} of {r['plans_predicted_to_fit']}"


def _peaks(r: dict[str, Any]) -> tuple[str, str]:
    """The peak / budget and within-budget cells (emulated rows hold no measured memory)."""
    if not r["memory_measured"]:
        return "not measured (emulated)", "n/a"
    yes = {True: "yes", False: "no"}
    return (f"{format_bytes(r['chosen_peak_bytes'])}; {format_bytes(r['trial_chosen_peak_bytes'])} / "
            f"{format_bytes(r['budget_bytes'])}",
            f"{yes[r['chosen_peak_bytes'] <= r['budget_bytes']]}; "
            f"{yes[r['trial_chosen_peak_bytes'] <= r['budget_bytes']]}")


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    header = ["model", "budget", "best measured plan", "best step", "its rank in the prediction",
              "choice by prediction alone", "predicted step",
              "measured step", "ratio", "choice with trials (plan=auto's default)", "measured step", "ratio",
              "peak / budget (prediction; trials)", "within 10%? (prediction; trials)",
              "within budget? (prediction; trials)"]
    yes = {True: "yes", False: "no"}
    body = [[r["workload"], f"{r['budget']} {format_bytes(r['budget_bytes'])}" if r["memory_measured"]
             else r["budget"], r["best"],
             f"{r['best_step_s'] * 1e3:.1f} ms", _rank(r), r["chosen"],
             f"{r['predicted_step_s'] * 1e3:.1f} ms",
             f"{r['chosen_step_s'] * 1e3:.1f} ms", f"{r['ratio']:.3f}", r["trial_chosen"],
             f"{r['trial_chosen_step_s'] * 1e3:.1f} ms", f"{r['trial_ratio']:.3f}", _peaks(r)[0],
             f"{yes[r['ratio'] >= 0.9]}; {yes[r['trial_ratio'] >= 0.9]}", _peaks(r)[1]]
            for r in rows]
    return header, body


def _judged(rows: list[dict[str, Any]], ratio: str, peak: str) -> tuple[int, int, int, dict[str, Any]]:
    close = sum(r[ratio] >= 0.9 for r in rows)
    memory = [r for r in rows if r["memory_measured"]]
    within = sum(r[peak] <= r["budget_bytes"] for r in memory)
    return close, within, len(memory), min(rows, key=lambda r: r[ratio])


def finding(rows: list[dict[str, Any]]) -> str:
    """Two lines computed from the rows: ``plan=auto`` as it runs by default (with trials), then the
    cost model's choice alone."""
    out = []
    for what, ratio, peak in (("plan=auto (its default trials)", "trial_ratio", "trial_chosen_peak_bytes"),
                              ("the choice by prediction alone (trials=0)", "ratio", "chosen_peak_bytes")):
        close, within, judged, worst = _judged(rows, ratio, peak)
        verdict = "target met" if close == len(rows) and within == judged else "target missed"
        out.append(f"Finding for {what} ({verdict}): within 10% of the best measured plan in {close} of "
                   f"{len(rows)} rows (lowest ratio {worst[ratio]:.3f}: {worst['workload']}, {worst['budget']} "
                   f"budget); measured memory within the budget in {within} of the {judged} rows on real stages.")
    ranks = [r["best_predicted_rank"] for r in rows]
    reached = sum(r is not None and r <= DEFAULT_TRIALS for r in ranks)
    out.append(f"The best measured plan's rank among the plans predicted to fit, fastest predicted first, per row: "
               f"{', '.join('over' if r is None else str(r) for r in ranks)}; {DEFAULT_TRIALS} trials reach it in "
               f"{reached} of {len(rows)} rows.")
    return "\n\n".join(out)


def main() -> None:
    """Plan, measure the grid, write ``plan_check.md`` / ``.json`` under ``--out``."""
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="more timed steps of the fastest plans and the chosen ones")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per layer in the profile")
    p.add_argument("--finalists", type=int, default=8, help="the fastest plans per budget timed again")
    args = p.parse_args()
    workloads, schedules = WORKLOADS, list(SCHEDULES)
    emulated = {"devices": EMULATED_DEVICES, "forward_ms": EMULATED_FORWARD_MS, "schedules": EMULATED_SCHEDULES}
    if args.tiny:
        workloads, schedules, args.steps, args.repeat, args.finalists = TINY, ["gpipe"], 1, 1, 2
        emulated = {"devices": 3, "forward_ms": 2.0, "schedules": ("gpipe",)}
    rows, grids, emulated_rows = [], {}, []
    for label, (preset, sizes, batch, max_m) in workloads.items():
        spec = WorkloadSpec(label, preset, sizes, batch)
        found, grids[label], profile = check_workload(label, spec, schedules, max_m, args.steps, args.repeat,
                                                      args.finalists, f"writing to {args.out}")
        rows += found
        found, grids[f"{label} (emulated)"] = check_emulated(label, spec, profile, max_m, args.steps, args.repeat,
                                                            args.finalists, f"writing to {args.out}", **emulated)
        emulated_rows += found
    rows += emulated_rows
    header, body = table(rows)
    specs = "; ".join(f"{k}: `{p}` {s}, batch {b}, M up to {m}" for k, (p, s, b, m) in workloads.items())
    md = ["# Automatic planning: the planner's choice against the best measured plan", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Workloads: {specs}. Planner: a fresh profile, {DEVICES} "
          f"devices (CPU stages, one thread each), schedules {', '.join(schedules)} (interleaved-1f1b with "
          f"{' and '.join(map(str, VIRTUAL_STAGES))} virtual stages per device), checkpoint modes never, "
          f"except_last, always, Adam's 16 bytes per parameter. Grid: every plan the planner "
          f"searched with K <= {DEVICES}, each run by GPipe for one timed step after one warm-up; the finalists "
          f"(the {args.finalists} fastest that fit each budget, and the chosen plans) for {args.steps} more, one "
          "step each per round, each after a warm-up; a plan's step is the fastest of its steps (other work on "
          "this shared machine only slows a step); the best measured plan is the fastest finalist that fits. "
          f"Two choices per row: the cost model's alone (`--trials 0`), and `plan=auto`'s default, which runs its "
          f"{DEFAULT_TRIALS} fastest predicted plans that fit for two timed steps each (`planner.trials`, measured "
          "before the grid, apart from it) and keeps the fastest measured; both choices are then judged by "
          "their grid measurements. Memory per stage: parameter state plus the engine's tracked peak saved activations "
          "(`track_memory`). Budgets: *loose* = the most any plan needs; *tight* = halfway between the least "
          "any plan needs and what the loose choice uses. Ratio = measured throughput of a choice / "
          "of the best measured plan that fits the budget (throughput ratio best step / chosen step). "
          f"Emulated devices (the last rows): the same networks with each layer sleeping its FLOPs share of a "
          f"{emulated['forward_ms']:g} ms mini-batch forward (backward twice that), K up to {emulated['devices']}, "
          f"schedules {', '.join(emulated['schedules'])} (no split backward: an emulated layer has no separate "
          "weight-gradient pass), the loose budget; their profile times the emulated layers (no contention "
          "between sleeping devices) with the engine overhead and hand-over measured for the real network, so "
          "these rows judge the search, the schedule simulation and the executor's own costs up to K=8; "
          "emulated layers hold no real activations, so their memory is not judged.", "",
          md_table(header, body), "", finding(rows), ""]
    print(write(args.out, "plan_check.md", "\n".join(md), {"rows": rows, "grids": grids}))


if __name__ == "__main__":
    main()

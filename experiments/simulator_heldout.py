"""The simulator judged on cells it was not tuned on: a frozen cost model, in-sample and held-out counts apart.

    python -m experiments.simulator_heldout --out results       # results/simulator_heldout.md / .json
    python -m experiments.simulator_heldout --tiny --out /tmp/sh

The cost model (``throughput_lib.timed_cost_model``: per-layer fixed + per-sample times
alone and beside a second stage, the engine's per-action overhead) is fitted ONCE from the
base width's layers timed at the micro-batches of ``FIT_M``; its hand-over per hop comes
from a separate calibration step (K=2 at ``CALIBRATION_M``, never judged). Frozen, it then
predicts measured K=2 steps:

- in-sample: the base width at the M whose micro-batch sizes the layers were timed at;
- held-out M: the base width at other M (other micro-batch sizes: between and beyond the fit's);
- held-out width: other widths at the held-out M; their layers are timed at the same sizes (the
  layer times are the model's input), while the hand-over, overhead and contention rule stay frozen;
- held-out K: K=4 and K=8 real CPU stages, where the machine has a core per stage (else the row
  says it does not fit).

Within 10% is counted for in-sample and held-out cells separately.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/simulator_heldout.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import dataclasses
import os

from experiments.common import parser, write
from experiments.throughput_lib import engine_overhead, error, hop_seconds, timed_cost_model
from gpipe_lab.bench import Progress
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table
from gpipe_lab.bench.step_timing import measure_step
from gpipe_lab.planner.workload import WorkloadSpec

#: The base workload (a Transformer analogue) and the settings of the full run.
BASE = {"num_layers": 16, "d_model": 128, "ffn_dim": 512, "num_heads": 4, "vocab_size": 512, "seq_len": 32,
        "dropout": 0.0}
FULL = {"batch": 128, "widths": (64, 256), "fit_m": (1, 8), "calibration_m": 2, "heldout_m": (4, 16),
        "heldout_k": (4, 8), "steps": 3, "repeat": 3}
#: ``--tiny``: a 4-layer, 16-wide network, one timed step.
TINY = {"batch": 16, "widths": (8,), "fit_m": (1, 4), "calibration_m": 2, "heldout_m": (8,), "heldout_k": (4,),
        "steps": 1, "repeat": 1}
TINY_BASE = {**BASE, "num_layers": 4, "d_model": 16, "ffn_dim": 32, "num_heads": 2, "vocab_size": 64,
             "seq_len": 8}


def workload(base: dict, width: int, batch: int) -> WorkloadSpec:
    """The Transformer analogue at ``width`` (FFN 4x wide)."""
    return WorkloadSpec(f"transformer d={width}", "transformer_l", {**base, "d_model": width, "ffn_dim": 4 * width},
                        batch)


def judged(kind: str, work: WorkloadSpec, width: int, k: int, m: int, cost: object, steps: int) -> dict:
    """Measure one cell and compare the frozen model's prediction with it."""
    measured, _, balance = measure_step(work, k, m, steps)
    predicted = cost.predict(balance, m, work.batch).step_time  # type: ignore[attr-defined]
    return {"cell": kind, "width": width, "K": k, "M": m, "micro_batch": work.batch // m, "balance": balance,
            "measured_s": measured, "simulated_s": predicted, "error": error(predicted, measured)}


def counts(rows: list[dict], held_out: bool) -> str:
    """One sentence: within 10% in how many of the in-sample or the held-out cells, and the largest error."""
    cells = [r for r in rows if r.get("error") is not None and (r["cell"] != "in-sample") == held_out]
    label = "held-out" if held_out else "in-sample"
    if not cells:
        return f"- {label}: no cell measured."
    worst = max(cells, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.10 for r in cells)
    return (f"- {label}: within 10% in {within} of {len(cells)} (largest error {worst['error']:+.1%}, "
            f"{worst['cell']} d={worst['width']} K={worst['K']} M={worst['M']}).")


def main() -> None:
    """Calibrate, freeze, judge; write ``simulator_heldout.md`` / ``.json`` under ``--out``."""
    p = parser(__doc__.split("\n")[0])
    args = p.parse_args()
    s, base = (TINY, TINY_BASE) if args.tiny else (FULL, BASE)
    width, cores = int(base["d_model"]), os.cpu_count() or 1
    fits = [k for k in s["heldout_k"] if k <= cores]
    jobs = 2 + len(s["fit_m"]) + len(s["heldout_m"]) * (1 + len(s["widths"]) + len(fits)) + len(s["widths"])
    progress = Progress(jobs, "simulator_heldout", note=f"writing to {args.out}")
    work = workload(base, width, s["batch"])
    _, calibration, _ = measure_step(work, 2, s["calibration_m"], s["steps"])
    hop = hop_seconds(calibration)
    progress.done(f"calibration step K=2 M={s['calibration_m']}: hand-over {hop * 1e3:.2f} ms")
    sizes = [s["batch"] // m for m in s["fit_m"]]
    overhead = engine_overhead()
    cost = timed_cost_model(work, sizes, s["repeat"], overhead, hop)
    progress.done(f"per-layer times at micro-batches {sizes}")
    rows = []
    for m in s["fit_m"]:
        rows.append(judged("in-sample", work, width, 2, m, cost, s["steps"]))
        progress.done(f"in-sample M={m}")
    for m in s["heldout_m"]:
        rows.append(judged("held-out M", work, width, 2, m, cost, s["steps"]))
        progress.done(f"held-out M={m}")
    for w in s["widths"]:
        other = workload(base, w, s["batch"])
        layers = timed_cost_model(other, sizes, s["repeat"], overhead, hop)
        frozen = dataclasses.replace(layers, action_overhead=cost.action_overhead, handover=cost.handover)
        progress.done(f"per-layer times at d={w}")
        for m in s["heldout_m"]:
            rows.append(judged("held-out width", other, w, 2, m, frozen, s["steps"]))
            progress.done(f"held-out d={w} M={m}")
    for k in s["heldout_k"]:
        for m in s["heldout_m"]:
            if k in fits:
                rows.append(judged("held-out K", work, width, k, m, cost, s["steps"]))
                progress.done(f"held-out K={k} M={m}")
            else:
                rows.append({"cell": "held-out K", "width": width, "K": k, "M": m, "micro_batch": s["batch"] // m,
                             "balance": None, "measured_s": None, "simulated_s": None, "error": None,
                             "note": f"does not fit: {k} CPU stages need {k} cores, this machine has {cores}"})
    header = ["cell", "width d", "K", "M", "micro-batch", "balance", "measured s/step", "simulated s/step",
              "simulator error"]
    table = [[r["cell"], r["width"], r["K"], r["M"], r["micro_batch"], r["balance"] or "-",
              f"{r['measured_s']:.4f}" if r["measured_s"] is not None else r.get("note", "-"),
              f"{r['simulated_s']:.4f}" if r["simulated_s"] is not None else "-",
              f"{r['error']:+.1%}" if r["error"] is not None else "-"] for r in rows]
    md = ["# The simulator on cells it was not tuned on", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Workload `transformer_l` {base} with mini-batch {s['batch']}, "
          f"CPU stages (one thread each), `except_last`, median of {s['steps']} timed step(s). The cost model is "
          f"fitted once from the d={width} layers timed at micro-batches {sizes} (M = {list(s['fit_m'])}), "
          f"{s['repeat']} repeat(s), alone and beside a second stage; engine overhead "
          f"{overhead * 1e3:.3f} ms per action; hand-over {hop * 1e3:.3f} ms per hop from a separate calibration "
          f"step (K=2, M={s['calibration_m']}, not judged). Held-out widths time their own layers at the same "
          "sizes; every other term stays frozen.", "", md_table(header, table), "",
          "Within 10% of the measured step, counted apart:", counts(rows, False), counts(rows, True), ""]
    print(write(args.out, "simulator_heldout.md", "\n".join(md),
                {"calibration": {"K": 2, "M": s["calibration_m"], "handover_s": hop, "overhead_s": overhead,
                                 "fit_micro_batches": sizes}, "rows": rows}))


if __name__ == "__main__":
    main()

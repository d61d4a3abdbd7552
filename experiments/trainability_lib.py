"""What one trainability run shows, and the sentences both trainability scripts compute from it.

A run's facts: the starting loss (step 0, before any update), the early spike (the
largest loss over the first ``EARLY`` steps / the starting loss), the final loss (mean
of the last 10 steps) against the starting loss, validation NLL, and the two verdicts:
``diverged`` (``nmt_lib.diverged`` judged from step 1: a non-finite step, or a loss
above 1.5 x the lowest loss so far) and ``learns`` (did not diverge and ended at most
``LEARNS`` x its starting loss).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from experiments.nmt_lib import RunResult, diverged

#: Steps over which the early spike is taken.
EARLY = 10
#: A run "learns" when its final loss is at most this fraction of its starting loss.
LEARNS = 0.75
#: Encoder and decoder layers per side of the depth controls.
DEPTHS = (1, 2, 6, 12, 24)
#: Divergence rule, as the files state it.
RULE = ("diverged = a non-finite step, or a loss above 1.5 x the lowest loss so far at any step from step 1 on; "
        f"early spike = the largest loss of steps 0-{EARLY} / the starting loss (step 0, before any update); "
        f"final / start = the mean loss of the last 10 steps / the starting loss; learns = not diverged and "
        f"final / start <= {LEARNS:g}")


def facts(r: RunResult, seed: int) -> dict:
    """The per-run numbers both files report (JSON-ready)."""
    losses = r.losses or [float("nan")]
    start = losses[0]
    final = statistics.fmean(losses[-10:])
    div = diverged(r.losses, r.nonfinite_steps)
    return {"seed": seed, "start": start, "early_spike": max(losses[:EARLY + 1]) / start,
            "final_over_start": final / start, "final": final, "val_nll": r.val_nll, "bleu": r.bleu,
            "diverged": div, "learns": (not div) and final / start <= LEARNS, "nonfinite": r.nonfinite_steps,
            "max_logit": max(r.max_logits, default=0.0), "max_grad_norm": max(r.grad_norms, default=0.0),
            "seconds": r.seconds}


def mean_range(values: Sequence[float], digits: int = 2) -> str:
    """``mean [min, max]`` of finite values (``-`` for none)."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return "-"
    lo, hi = min(finite), max(finite)
    return f"{statistics.fmean(finite):.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def cells(runs: Sequence[dict]) -> list[str]:
    """diverged / learns counts, early spike, final / start, val NLL (mean [range]) of a group of runs."""
    n = len(runs)
    return [f"{sum(r['diverged'] for r in runs)} / {n}", f"{sum(r['learns'] for r in runs)} / {n}",
            mean_range([r["early_spike"] for r in runs]), mean_range([r["final_over_start"] for r in runs]),
            mean_range([r["val_nll"] for r in runs])]


CELL_HEADER = ["diverged / seeds", "learns / seeds", "early spike (x start)", "final / start", "val NLL"]


def depth_verdict(baseline: dict[int, list[dict]], fixed: list[dict] | None) -> tuple[bool, str]:
    """Whether divergence comes with depth and the fixes keep the deepest model learning, in words.

    ``baseline`` maps layers per side to the baseline's runs (any depths run so far),
    ``fixed`` are the deepest depth's runs with both fixes (None: not run). The effect
    holds when the deepest baseline diverges in at least 2 of 3 runs' share, the two
    shallowest depths run diverge in none, and every fixed run learns.
    """
    depths = sorted(baseline)
    deep = depths[-1]
    n_deep = sum(r["diverged"] for r in baseline[deep])
    words = [f"baseline at L={deep} diverged in {n_deep} of {len(baseline[deep])}"]
    ok = 3 * n_deep >= 2 * len(baseline[deep])
    shallow = [d for d in depths if d != deep][:2]
    for d in shallow:
        n = sum(r["diverged"] for r in baseline[d])
        words.append(f"at L={d} in {n} of {len(baseline[d])}")
        ok = ok and n == 0
    if len(shallow) < 2:
        ok = False
    if fixed is not None:
        learns = sum(r["learns"] for r in fixed)
        words.append(f"with both fixes at L={deep}: {sum(r['diverged'] for r in fixed)} diverged, "
                     f"{learns} of {len(fixed)} learn")
        ok = ok and learns == len(fixed)
    else:
        ok = False
    return ok, "; ".join(words)

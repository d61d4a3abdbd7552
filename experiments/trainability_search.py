"""Search for a CPU-sized setting where the baseline Transformer diverges with depth and the fixes keep it learning.

    python -m experiments.trainability_search --out results       # the whole grid, 45 wall-minute budget
    python -m experiments.trainability_search --first 3 --out results   # keep --out's rows 0-2, run the rest
    python -m experiments.trainability_search --tiny --out /tmp/search

Each setting of ``GRID`` (width, pre/post-norm, Adam lr, linear warm-up, steps) is
tried with the same lr, warm-up and steps at every depth of ``trainability_lib.DEPTHS``
(layers per side), 3 seeds each, in the order that can reject it soonest: the baseline
(no FFN init scaling, no logit clip) at the deepest depth (a miss unless it diverges in
>= 2 of 3), then at the two shallowest (a miss if either diverges at all), then the deepest
with both fixes (a miss unless every seed learns), then the other depths (the profile).
Settings are tried in grid order until one shows the depth effect or the wall-clock budget
is spent. ``GRID`` was extended after each miss: every setting in it was tried, in order,
and the file shows each with the reason it missed. ``--first N`` keeps the first N rows of
``--out``'s previous JSON (they must match ``GRID[:N]``; each row keeps the commit and date
it ran at) and runs the rest.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/trainability_search.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import json
import time

from experiments.common import parser, write
from experiments.nmt_lib import train_translation
from experiments.trainability_lib import DEPTHS, RULE, depth_verdict, facts, mean_range
from gpipe_lab.bench import Progress
from gpipe_lab.bench.machine import provenance, provenance_meta
from gpipe_lab.bench.markdown import md_table

_NARROW = {"d_model": 32, "ffn_dim": 128, "num_heads": 2}
#: Settings in the order they were tried; each was appended after the previous one missed.
GRID: list[dict] = [
    {**_NARROW, "pre_norm": False, "lr": 0.01, "warmup": 0, "steps": 40},
    {**_NARROW, "pre_norm": True, "lr": 0.1, "warmup": 0, "steps": 40},
    {**_NARROW, "pre_norm": True, "lr": 0.3, "warmup": 0, "steps": 40},
    {**_NARROW, "pre_norm": True, "lr": 0.03, "warmup": 10, "steps": 80},
    {**_NARROW, "pre_norm": True, "lr": 0.1, "warmup": 10, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.03, "warmup": 10, "steps": 80},
    {**_NARROW, "pre_norm": True, "lr": 0.3, "warmup": 10, "steps": 80},
    {**_NARROW, "pre_norm": True, "lr": 0.2, "warmup": 0, "steps": 80},
    {**_NARROW, "pre_norm": True, "lr": 1.0, "warmup": 10, "steps": 80},
    {**_NARROW, "pre_norm": True, "lr": 0.5, "warmup": 10, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.1, "warmup": 0, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.3, "warmup": 0, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.2, "warmup": 0, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.15, "warmup": 0, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.18, "warmup": 0, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.2, "warmup": 3, "steps": 80},
    {**_NARROW, "pre_norm": False, "lr": 0.18, "warmup": 0, "steps": 160},
    {**_NARROW, "pre_norm": False, "lr": 0.2, "warmup": 3, "steps": 160},
]
SEEDS = (0, 1, 2)
BOTH = {"ffn_init_scaling": True, "logit_clip": 10.0}
#: ``--tiny``: one small setting at two depths, one seed, three steps.
TINY_GRID: list[dict] = [{"d_model": 16, "ffn_dim": 32, "num_heads": 2, "pre_norm": True, "lr": 0.01, "warmup": 0,
                          "steps": 3}]


def run_depth(setting: dict, layers: int, seeds: tuple[int, ...], num_train: int, fixes: dict,
              progress: Progress) -> list[dict]:
    """One depth of one setting, every seed; the runs' facts."""
    model = {k: v for k, v in setting.items() if k not in ("lr", "warmup", "steps")}
    runs = []
    for seed in seeds:
        r = train_translation(int(setting["steps"]), seed=seed, lr=float(setting["lr"]), warmup=int(setting["warmup"]),
                              batch_size=32, num_train=num_train, num_val=32, eval_batches=1, num_layers=layers,
                              **model, **fixes)
        runs.append(facts(r, seed))
        progress.done(f"{setting} L={layers} {'both fixes ' if fixes else ''}seed {seed}")
    return runs


def try_setting(setting: dict, depths: tuple[int, ...], seeds: tuple[int, ...], num_train: int,
                progress: Progress) -> dict:
    """Run ``setting`` until it misses or shows the effect; returns its row (runs by depth, verdict)."""
    began, meta = time.perf_counter(), provenance_meta()  # the code that runs: edits made meanwhile do not count
    baseline: dict[int, list[dict]] = {}
    fixed = None
    deep, shallow, rest = depths[-1], depths[:2], depths[2:-1]
    baseline[deep] = run_depth(setting, deep, seeds, num_train, {}, progress)
    if 3 * sum(r["diverged"] for r in baseline[deep]) >= 2 * len(seeds):
        for d in shallow:
            baseline[d] = run_depth(setting, d, seeds, num_train, {}, progress)
        if not any(r["diverged"] for d in shallow for r in baseline[d]):
            fixed = run_depth(setting, deep, seeds, num_train, BOTH, progress)
            if all(r["learns"] for r in fixed):
                for d in rest:
                    baseline[d] = run_depth(setting, d, seeds, num_train, {}, progress)
    ok, reason = depth_verdict(baseline, fixed)
    return {"setting": setting, "effect": ok, "reason": reason, "commit": meta["commit"], "date": meta["date"],
            "minutes": (time.perf_counter() - began) / 60,
            "baseline": {str(d): runs for d, runs in sorted(baseline.items())}, "both_fixes_deepest": fixed}


def kept_rows(path: object, first: int, grid: list[dict]) -> list[dict]:
    """The first ``first`` rows of a previous search JSON, checked against ``grid``.

    Raises:
        ValueError: ``first`` > 0 without that JSON, or its rows do not match the grid's first settings.
    """
    if first == 0:
        return []
    if not path.exists():
        raise ValueError(f"--first {first} needs the previous {path}, which does not exist")
    rows = json.loads(path.read_text())["tried"][:first]
    if len(rows) < first or [r["setting"] for r in rows] != grid[:first]:
        raise ValueError(f"--first {first}: {path} does not hold GRID[:{first}] (it has "
                         f"{[r['setting'] for r in rows]})")
    return rows


def table(tried: list[dict], depths: tuple[int, ...]) -> tuple[list[str], list[list[object]]]:
    """One row per setting: divergences per depth, the fixed deepest run, final / start, verdict."""
    header = ["#", "setting", *(f"none L={d}: diverged" for d in depths), f"both L={depths[-1]}: diverged / learns",
              f"final / start, none L={depths[-1]}", f"final / start, both L={depths[-1]}", "depth effect", "commit"]
    rows = []
    for i, t in enumerate(tried):
        base, fixed = t["baseline"], t["both_fixes_deepest"]
        per_depth = [f"{sum(r['diverged'] for r in base[str(d)])} / {len(base[str(d)])}" if str(d) in base
                     else "not run" for d in depths]
        deep = base.get(str(depths[-1]), [])
        rows.append([i, t["setting"], *per_depth,
                     f"{sum(r['diverged'] for r in fixed)} / {sum(r['learns'] for r in fixed)} of {len(fixed)}"
                     if fixed else "not run", mean_range([r["final_over_start"] for r in deep]),
                     mean_range([r["final_over_start"] for r in fixed or []]), "yes" if t["effect"] else "no",
                     f"`{t['commit']}`"])
    return header, rows


def depth_comparison(tried: list[dict], depths: tuple[int, ...]) -> str:
    """A sentence computed from the rows: where the deepest baseline diverged, did the shallowest diverge less?"""
    deep, shallow = str(depths[-1]), [str(d) for d in depths[:2]]
    hits = [(i, t) for i, t in enumerate(tried) if 3 * sum(r["diverged"] for r in t["baseline"][deep])
            >= 2 * len(t["baseline"][deep]) and all(d in t["baseline"] for d in shallow)]
    if not hits:
        return f"The L={deep} baseline diverged in >= 2 of 3 seeds in none of the settings tried."
    count = {i: {d: sum(r["diverged"] for r in t["baseline"][d]) for d in (deep, *shallow)} for i, t in hits}
    as_often = [i for i in count if all(count[i][d] >= count[i][deep] for d in shallow)]
    parts = ", ".join(f"#{i}: L={deep} {c[deep]}, " + ", ".join(f"L={d} {c[d]}" for d in shallow)
                      for i, c in count.items())
    return (f"Where the L={deep} baseline diverged in >= 2 of 3 seeds ({parts} diverged runs), the shallow "
            f"baselines diverged in as many seeds or more in {len(as_often)} of {len(hits)} setting(s)"
            + (": in this grid divergence comes with the learning rate and warm-up, not with depth."
               if len(as_often) == len(hits) else "."))


def main() -> None:
    """Run the grid within ``--budget-min`` wall-clock minutes; write the search table under ``--out``.

    Raises:
        ValueError: ``--first`` without a matching previous JSON under ``--out``.
    """
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--budget-min", type=float, default=45.0, help="stop starting settings after this (minutes)")
    p.add_argument("--first", type=int, default=0, help="keep this many rows of --out's previous JSON")
    args = p.parse_args()
    grid, seeds, depths = (TINY_GRID, SEEDS[:1], DEPTHS[:3]) if args.tiny else (GRID, SEEDS, DEPTHS)
    tried = kept_rows(args.out / "trainability_search.json", args.first, grid)
    start = time.perf_counter()
    progress = Progress(len(grid[args.first:]) * len(seeds) * (len(depths) + 1), "trainability_search",
                        note=f"at most; stops at the first setting with a depth effect; writing to {args.out}")
    found = next((t for t in tried if t["effect"]), None)
    for setting in grid[len(tried):]:
        if found or (time.perf_counter() - start) / 60 > args.budget_min:
            break
        tried.append(try_setting(setting, depths, seeds, 800 if args.tiny else 3000, progress))
        print(f"{setting}: {tried[-1]['reason']}", flush=True)
        found = tried[-1] if tried[-1]["effect"] else None
    minutes = (time.perf_counter() - start) / 60
    verdict_depth = depth_comparison(tried, depths)
    header, rows = table(tried, depths)
    if found:
        verdict = (f"Depth effect found at setting #{tried.index(found)} {found['setting']}: {found['reason']}.")
    else:
        verdict = (f"Not reproduced here: none of the {len(tried)} settings tried shows the baseline diverging "
                   f"with depth while both fixes keep the L={depths[-1]} model learning. Per setting: "
                   + " | ".join(f"#{i} {t['reason']}" for i, t in enumerate(tried)) + ".")
    md = ["# Trainability search: does the baseline diverge with depth, and do the fixes keep it learning?", "",
          provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Encoder-decoder `transformer_tiny`, Adam (betas 0.9/0.98) with "
          f"linear warm-up over `warmup` steps, batch 32 sentences, K=2, M=2, seeds {list(seeds)}; depths "
          f"L = {list(depths)} layers per side at the same lr, warm-up and steps; baseline = no FFN init scaling, "
          f"no logit clip; both = FFN init scaling and logit clip 10. {RULE}. The grid was extended after each "
          f"miss: every setting below was tried, in this order, and stopped at its first failed condition "
          f"('not run' cells). {len(tried) - args.first} setting(s) run now in {minutes:.1f} wall minutes "
          f"(budget {args.budget_min:g}), {args.first} kept from the previous JSON (their commit below); "
          f"{sum(t['minutes'] for t in tried):.1f} wall minutes for all {len(tried)}.", "",
          md_table(header, rows), "", verdict, "", verdict_depth, ""]
    print(write(args.out, "trainability_search.md", "\n".join(md), {"depths": list(depths), "tried": tried,
                                                                     "found": found}))


if __name__ == "__main__":
    main()

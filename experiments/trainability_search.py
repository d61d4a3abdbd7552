"""Search for a CPU-sized setting where the baseline deep Transformer diverges (for ``trainability.py``).

    python -m experiments.trainability_search                      # the grid below, 40 CPU-minute budget
    python -m experiments.trainability_search --budget-min 5 --out /tmp/search
    python -m experiments.trainability_search --first 5 --budget-min 20   # the settings after the fifth
    python -m experiments.trainability_search --first 7 --out results      # the last: the committed search

Trains the baseline (no FFN init scaling, no logit clip) with 3 seeds at each
setting of ``GRID`` in order, one thread per run, until a setting diverges in at
least 2 of 3 seeds (``nmt_lib.diverged``: a non-finite step, or a loss above 1.5 x
the lowest loss so far after step 10) or the budget is spent. Writes
``trainability_search.md`` / ``.json`` under ``--out``: every setting tried, its
divergence count, and which one (if any) was found. The search is the evidence
for the setting in ``conf/experiment/paper_trainability.yaml``.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/trainability_search.py``): rerun as the module
    from gpipe_lab.bench.launch import rerun_as_module

    rerun_as_module(__file__)

import time

from experiments.common import parser, provenance, write
from experiments.nmt_lib import diverged, train_translation
from gpipe_lab.bench import Progress
from gpipe_lab.bench.markdown import md_table

#: Settings tried in order: deeper, narrower, post-norm, larger learning rates, no warm-up.
GRID: list[dict] = [
    {"num_layers": 12, "d_model": 32, "ffn_dim": 128, "num_heads": 2, "pre_norm": False, "lr": 0.01, "steps": 60},
    {"num_layers": 24, "d_model": 32, "ffn_dim": 128, "num_heads": 2, "pre_norm": False, "lr": 0.01, "steps": 60},
    {"num_layers": 24, "d_model": 32, "ffn_dim": 128, "num_heads": 2, "pre_norm": True, "lr": 0.03, "steps": 60},
    {"num_layers": 24, "d_model": 32, "ffn_dim": 128, "num_heads": 2, "pre_norm": False, "lr": 0.03, "steps": 60},
    {"num_layers": 32, "d_model": 16, "ffn_dim": 64, "num_heads": 2, "pre_norm": False, "lr": 0.05, "steps": 60},
    {"num_layers": 12, "d_model": 32, "ffn_dim": 128, "num_heads": 2, "pre_norm": True, "lr": 0.1, "steps": 40},
    {"num_layers": 12, "d_model": 32, "ffn_dim": 128, "num_heads": 2, "pre_norm": True, "lr": 0.3, "steps": 40},
    {"num_layers": 12, "d_model": 32, "ffn_dim": 128, "num_heads": 2, "pre_norm": True, "lr": 0.5, "steps": 60},
]
SEEDS = (0, 1, 2)
#: ``--tiny``: one small setting, two steps per seed.
TINY_GRID: list[dict] = [{"num_layers": 2, "d_model": 16, "ffn_dim": 32, "num_heads": 2, "pre_norm": False,
                          "lr": 0.01, "steps": 2}]


def run_setting(setting: dict, seeds: tuple[int, ...], num_train: int, progress: Progress | None = None) -> dict:
    """Train the baseline at ``setting`` once per seed; returns the divergence count and per-seed facts."""
    model = {k: v for k, v in setting.items() if k not in ("lr", "steps")}
    runs = []
    for seed in seeds:
        r = train_translation(int(setting["steps"]), seed=seed, lr=float(setting["lr"]), batch_size=32,
                              num_train=num_train, num_val=32, eval_batches=1, **model)
        runs.append({"seed": seed, "diverged": diverged(r.losses, r.nonfinite_steps),
                     "nonfinite": r.nonfinite_steps, "final_loss": r.losses[-1] if r.losses else None,
                     "max_logit": max(r.max_logits, default=0.0), "max_grad_norm": max(r.grad_norms, default=0.0),
                     "seconds": r.seconds})
        if progress is not None:
            progress.done(f"{setting} seed {seed}")
    return {"setting": setting, "diverged": sum(r["diverged"] for r in runs), "runs": runs}


def main() -> None:
    """Run the grid within ``--budget-min`` CPU minutes; write the search table under ``--out``."""
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--budget-min", type=float, default=40.0, help="stop starting settings after this (minutes)")
    p.add_argument("--first", type=int, default=0, help="start at this index of the grid (resume a search)")
    args = p.parse_args()
    grid, seeds = (TINY_GRID, SEEDS[:1]) if args.tiny else (GRID[args.first:], SEEDS)
    start, tried, found = time.process_time(), [], None
    progress = Progress(len(grid) * len(seeds), "trainability_search",
                        note=f"at most; stops at the first setting that diverges; writing to {args.out}")
    for setting in grid:
        if (time.process_time() - start) / 60 > args.budget_min:
            break
        tried.append(run_setting(setting, seeds, 800 if args.tiny else 3000, progress))
        print(tried[-1]["setting"], "diverged", tried[-1]["diverged"], "of", len(seeds), flush=True)
        if tried[-1]["diverged"] >= 2:
            found = tried[-1]
            break
    cpu_min = (time.process_time() - start) / 60
    header = ["setting", "diverged / seeds", "final losses", "largest abs logit", "largest grad norm"]
    table = [[t["setting"], f"{t['diverged']} / {len(seeds)}", [f"{r['final_loss']:.2f}" for r in t["runs"]],
              f"{max(r['max_logit'] for r in t['runs']):.1f}", f"{max(r['max_grad_norm'] for r in t['runs']):.2f}"]
             for t in tried]
    verdict = (f"Found: {found['setting']} diverges in {found['diverged']} of {len(seeds)} seeds."
               if found else f"No setting of the {len(tried)} tried diverged in >= 2 of {len(seeds)} seeds.")
    md = ["# Trainability search: where does the baseline diverge?", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Baseline (no FFN init scaling, no logit clip), Adam without "
          f"warm-up, batch 32, K=2, M=2; diverged = a non-finite step or a loss above 1.5 x the lowest so far "
          f"after step 10. {len(tried)} of {len(grid)} settings tried in {cpu_min:.1f} CPU minutes "
          f"(budget {args.budget_min:g}).", "", md_table(header, table), "", verdict, ""]
    print(write(args.out, "trainability_search.md", "\n".join(md), {"tried": tried, "found": found}))


if __name__ == "__main__":
    main()

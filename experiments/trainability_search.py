"""Selection for the trainability report: learning rate and warm-up chosen on selection seeds, never on the report's.

    python -m experiments.trainability_search --out results   # results/trainability_search.md + .json
    python -m experiments.trainability_search --tiny --out /tmp/tr

Trains the shallow post-norm baseline (``experiment.selection_depth`` layers per side, no fix)
at every (lr, warm-up) of ``experiment.lrs`` x ``experiment.warmups`` for ``trainer.max_steps``
steps on each of ``experiment.selection_seeds``, and chooses by ``CHOICE``: the setting a user
tunes on a small model before scaling it up. The choice never looks at a deep model or at a fix,
so it cannot favour the claim. ``experiments.trainability`` reads the choice from the JSON.
Runs: ``trainability_lib.train`` (plain PyTorch, K=1), ``experiment.workers`` processes.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/trainability_search.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import statistics
from typing import Any

from experiments.common import parser, run_main, write
from experiments.trainability_lib import BAR, RULES, Run, Setting, Task, count, mean_range, train_all
from gpipe_lab.bench import Progress
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table

EXPERIMENT = "paper_trainability"
#: ``--tiny``: two settings, one seed, a 1-layer model of width 16, 4 steps.
TINY = {EXPERIMENT: ["model.d_model=16", "model.ffn_dim=32", "trainer.max_steps=4", "experiment.lrs=[0.003,0.01]",
                     "experiment.warmups=[0]", "experiment.selection_seeds=[0]", "experiment.selection_depth=1",
                     "experiment.seeds=[0]", "model.num_layers=2", "experiment.depths=[1,2]",
                     "data.num_train=200", "data.num_val=16", "experiment.workers=1"]}
CHOICE = (f"chosen = among the settings where the shallow baseline learns (BLEU >= {BAR:g}) on every selection "
          "seed, the highest mean selection BLEU (rounded to 0.1), ties to the smaller lr, then the longer warm-up; "
          "with none learning, the highest mean BLEU by the same ties")


def task_of(cfg: Any) -> Task:
    """The model width and data of a composed ``paper_trainability`` config."""
    m, d = cfg.model, cfg.data
    return Task(d_model=int(m.d_model), ffn_dim=int(m.ffn_dim), num_heads=int(m.num_heads),
                batch_size=int(d.batch_size), num_train=int(d.num_train), num_val=int(d.num_val),
                min_len=int(d.min_len), max_len=int(d.max_len))


def choose(rows: list[dict]) -> dict:
    """The chosen row by ``CHOICE`` (each row: ``lr``, ``warmup``, ``runs`` with ``bleu`` and ``learns``).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("choose needs at least one selection row")
    passing = [r for r in rows if all(run["learns"] for run in r["runs"])] or rows
    return max(passing, key=lambda r: (round(statistics.fmean(run["bleu"] for run in r["runs"]), 1), -r["lr"],
                                       r["warmup"]))


def main() -> None:
    """Run the selection grid; write ``trainability_search.md`` / ``.json`` under ``--out``.

    Raises:
        ValueError: a bad override.
    """
    from experiments.common import configs

    args = parser(__doc__.split("\n")[0], [EXPERIMENT]).parse_args()
    cfg = configs(args, [EXPERIMENT], TINY)[EXPERIMENT]
    e, task, steps = cfg.experiment, task_of(cfg), int(cfg.trainer.max_steps)
    seeds, depth = [int(s) for s in e.selection_seeds], int(e.selection_depth)
    grid = [(float(lr), int(w)) for lr in e.lrs for w in e.warmups]
    runs = [Run(depth, False, "none", s, Setting(lr, w, steps), task, float(e.logit_clip))
            for lr, w in grid for s in seeds]
    progress = Progress(len(runs), "trainability_search", note=f"writing to {args.out}")
    done = train_all(runs, int(e.workers), lambda r: progress.done(f"lr {r['setting']['lr']} warm-up "
                                                                   f"{r['setting']['warmup']} seed {r['seed']}"))
    rows = [{"lr": lr, "warmup": w, "runs": done[i * len(seeds):(i + 1) * len(seeds)]} for i, (lr, w) in
            enumerate(grid)]
    chosen = choose(rows)
    header = ["lr", "warm-up steps", "learns / seeds", "diverged / seeds", "BLEU", "exact match",
              "final / start", "chosen"]
    table = [[r["lr"], r["warmup"], count(r["runs"], "learns"), count(r["runs"], "diverged"),
              mean_range([x["bleu"] for x in r["runs"]]), mean_range([x["exact"] for x in r["runs"]], 2),
              mean_range([x["final_over_start"] for x in r["runs"]], 3), "yes" if r is chosen else ""] for r in rows]
    setting = {"lr": chosen["lr"], "warmup": chosen["warmup"], "steps": steps}
    md = ["# Trainability selection: learning rate and warm-up, chosen on selection seeds", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}The post-norm baseline (no fix) with L={depth} layers per side, "
          f"{task}, on the built-in synthetic language pair ({task.min_len}-{task.max_len} source words), "
          f"plain PyTorch (K=1, no pipeline), Adam (betas 0.9/0.98) with linear warm-up, {steps} steps, "
          f"selection seeds {seeds} (the report's seeds {list(e.seeds)} are not used here). The bar, fixed before "
          f"any run: {RULES}. Cells are mean [min, max] over the selection seeds; {CHOICE}.", "",
          md_table(header, table), "",
          f"Chosen: lr {setting['lr']:g}, warm-up {setting['warmup']} steps, {steps} steps "
          f"(learns in {count(chosen['runs'], 'learns')} selection seeds).", ""]
    print(write(args.out, "trainability_search.md", "\n".join(md),
                {"chosen": setting, "selection_seeds": seeds, "selection_depth": depth, "rows": rows}))


if __name__ == "__main__":
    run_main(main)

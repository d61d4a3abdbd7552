"""Trainability of a deep narrow Transformer (paper §5): FFN init scaling and logit clipping, against depth.

    python -m experiments.trainability_search --out results   # first: lr and warm-up chosen on selection seeds
    python -m experiments.trainability --out results          # results/trainability.md + .json + .png
    python -m experiments.trainability --tiny --out /tmp/tr
    python -m experiments.trainability --from-multirun logs/train/multiruns/<time>   # gpipe-train jobs' table

At the setting ``trainability_search`` chose (its JSON, ``--search``), on the fresh seeds
``experiment.seeds``: the post-norm baseline (the paper's) at every depth of
``experiment.depths``; at the deepest, the post-norm model with each fix (FFN init scaling,
logit clip, both) and the pre-norm model without a fix (the control). Each
run: ``trainability_lib.train`` (plain PyTorch, K=1, on short sentences of the built-in
synthetic language pair). The bar for "learns", the divergence rule and the rule for
"reproduced" are fixed in ``trainability_lib`` before any run and printed in the file;
the verdict is computed from the runs. Settings: ``conf/experiment/paper_trainability.yaml``.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/trainability.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import json
import statistics
from pathlib import Path

from experiments.common import configs, log_wandb, parser, run_main, save_figure, write
from experiments.trainability_collect import EXPERIMENT, PAPER_FIX, collected, plot_collected
from experiments.trainability_lib import (
    RULE,
    RULES,
    VARIANTS,
    Run,
    Setting,
    count,
    mean_range,
    train_all,
    verdict,
)
from experiments.trainability_search import TINY, task_of
from gpipe_lab.bench import Progress
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table

#: Variants of the pre-norm control at the deepest depth (without a fix: does the post-norm baseline's
#: trouble come from depth or from post-norm?).
CONTROL = ("none",)


def chosen_setting(path: Path, tiny: bool, lr: float, steps: int) -> tuple[Setting, str]:
    """The selection's setting from its JSON, and how it was chosen (``tiny``: ``lr`` without warm-up when absent).

    Raises:
        ValueError: no selection JSON at ``path`` outside ``--tiny``.
    """
    if path.exists():
        data = json.loads(path.read_text())
        c = data["chosen"]
        return Setting(float(c["lr"]), int(c["warmup"]), int(c["steps"])), (
            f"chosen by `experiments.trainability_search` on selection seeds {data['selection_seeds']} "
            f"(`{path.name}`, commit `{data['meta']['commit']}`)")
    if not tiny:
        raise ValueError(f"--search {path} does not exist: run `python -m experiments.trainability_search --out "
                         f"{path.parent}` first (the report's lr and warm-up are chosen on selection seeds)")
    return Setting(lr, 0, steps), "not selected (TINY smoke run: optimizer.lr, no warm-up)"


def plan(depths: list[int], seeds: list[int], setting: Setting, task: object, clip: float) -> list[Run]:
    """Every run of the report: the post-norm baseline per depth, the fixes and the pre-norm control at the deepest."""
    deep = depths[-1]
    groups = [(False, "none", d) for d in depths] + [(False, v, deep) for v in VARIANTS[1:]] + \
             [(True, v, deep) for v in CONTROL]
    return [Run(layers, pre, variant, s, setting, task, clip) for pre, variant, layers in groups for s in seeds]


def grouped(runs: list[dict]) -> dict[tuple[str, str, int], list[dict]]:
    """The runs by (norm, variant, layers per side), in plan order."""
    out: dict[tuple[str, str, int], list[dict]] = {}
    for r in runs:
        out.setdefault(("pre" if r["pre_norm"] else "post", r["variant"], r["layers"]), []).append(r)
    return out


def row(key: tuple[str, str, int], rs: list[dict], clip: float) -> list[object]:
    """One table row: learns, diverged, transient spikes, BLEU, exact match, final / start, the clip's binding."""
    norm, variant, layers = key
    steps = sum(r["steps_run"] for r in rs)
    clipping = variant in ("logit clip", "both")
    return [f"{norm}-norm", variant, layers, f"{rs[0]['params']:,}", count(rs, "learns"), count(rs, "diverged"),
            count(rs, "transient_spike"), mean_range([r["spike"] for r in rs], 2), mean_range([r["bleu"] for r in rs]),
            mean_range([r["exact"] for r in rs], 2), mean_range([r["final_over_start"] for r in rs], 3),
            f"{sum(r['clip_steps'] for r in rs)} / {steps}" + ("" if clipping else " (unclipped)"),
            f"{statistics.fmean(r['clip_share'] for r in rs):.2%}", PAPER_FIX[variant] if norm == "post" else "control"]


HEADER = ["norm", "variant", "layers per side", "parameters", "learns / seeds", "diverged / seeds",
          "transient spike / seeds", "largest rise (x start)", "val BLEU", "exact match", "final / start", "logits above t: runs' steps",
          "share of logits above t", "paper (§5)"]


def findings(groups: dict[tuple[str, str, int], list[dict]], depths: list[int], clip: float) -> list[str]:
    """The verdict and the sentences computed from the runs."""
    deep = depths[-1]
    shallow = [r for d in depths[:2] for r in groups[("post", "none", d)]]
    outcome, reason = verdict(shallow, groups[("post", "none", deep)], groups[("post", "both", deep)])
    lines = [f"- **{outcome.capitalize()}** here: {reason}. Rule: {RULE}."]
    learned = [d for d in depths if all(r["learns"] for r in groups[("post", "none", d)])]
    lines.append(f"- Post-norm baseline: every seed learns at L = {learned or 'none'}; learns per depth: "
                 + ", ".join(f"L={d} {count(groups[('post', 'none', d)], 'learns')}" for d in depths) + ".")
    for (norm, variant, layers), rs in groups.items():
        if layers != deep:
            continue
        lines.append(f"- {norm}-norm, {variant}, L={deep}: learns {count(rs, 'learns')}, diverged "
                     f"{count(rs, 'diverged')}, transient spike {count(rs, 'transient_spike')}, BLEU "
                     f"{mean_range([r['bleu'] for r in rs])}.")
    bound = [r for (n, v, d), rs in groups.items() if v in ("logit clip", "both") for r in rs]
    lines.append(f"- The clip (t = {clip:g}) bound in {sum(r['clip_steps'] > 0 for r in bound)} of {len(bound)} "
                 f"clipped runs, at {sum(r['clip_steps'] for r in bound)} of {sum(r['steps_run'] for r in bound)} "
                 "of their steps.")
    return lines


def plot(groups: dict[tuple[str, str, int], list[dict]], depths: list[int], path: Path) -> Path:
    """Loss curves: the post-norm baseline per depth (left), every variant at the deepest depth (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    right = [k for k in groups if k[2] == depths[-1]]
    for key, rs in groups.items():
        ax, colour = (a, f"C{depths.index(key[2])}") if key[1] == "none" and key[0] == "post" and \
            key[2] != depths[-1] else (b, f"C{right.index(key)}")
        for j, r in enumerate(rs):
            ax.plot(r["losses"], color=colour, alpha=0.6, lw=0.8,
                    label=f"{key[0]}-norm {key[1]}, L={key[2]}" if j == 0 else None)
    a.set(xlabel="step", ylabel="training loss (token mean)", yscale="log", title="post-norm baseline, shallower")
    b.set(xlabel="step", yscale="log", title=f"L={depths[-1]} per side: the fixes and the pre-norm control")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def main() -> None:
    """Train every run of the plan; write ``trainability.md`` / ``.json`` / ``.png`` under ``--out``.

    Raises:
        ValueError: a bad override, depths not rising to ``model.num_layers``, fewer than two depths, or
            no selection JSON (outside ``--tiny``).
    """
    p = parser(__doc__.split("\n")[0], [EXPERIMENT], multirun=True)
    p.add_argument("--search", type=Path, help="trainability_search's JSON (default: --out's)")
    args = p.parse_args()
    if args.from_multirun:
        header, table, text, data = collected(args.from_multirun)
        args.out.mkdir(parents=True, exist_ok=True)
        png = plot_collected(data, args.out / "trainability.png")
        md = ["# Trainability of a deep narrow Transformer", "", provenance(), "", text, "",
              md_table(header, table), "", "![final losses](trainability.png)", ""]
        path = write(args.out, "trainability.md", "\n".join(md), data)
        log_wandb(args.wandb, args.out, "trainability", {"trainability": (header, table)}, [png])
        print(path)
        return
    cfg = configs(args, [EXPERIMENT], TINY)[EXPERIMENT]
    e, task = cfg.experiment, task_of(cfg)
    depths, seeds, clip = [int(x) for x in e.depths], [int(s) for s in e.seeds], float(e.logit_clip)
    if len(depths) < 2 or depths[-1] != int(cfg.model.num_layers) or depths != sorted(set(depths)):
        raise ValueError(f"experiment.depths={depths} must be two or more depths rising to "
                         f"model.num_layers={cfg.model.num_layers}")
    setting, how = chosen_setting(args.search or args.out / "trainability_search.json", args.tiny,
                                  float(cfg.optimizer.lr), int(cfg.trainer.max_steps))
    runs = plan(depths, seeds, setting, task, clip)
    progress = Progress(len(runs), "trainability", note=f"writing to {args.out}")
    done = train_all(runs, int(e.workers), lambda r: progress.done(
        f"{'pre' if r['pre_norm'] else 'post'}-norm {r['variant']} L={r['layers']} seed {r['seed']}"))
    groups = grouped(done)
    order = sorted(groups, key=lambda k: (k[0] == "pre", k[1] != "none", k[2], VARIANTS.index(k[1])))
    table = [row(k, groups[k], clip) for k in order]
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(groups, depths, args.out / "trainability.png")
    minutes = sum(r["seconds"] for r in done) / 60
    md = ["# Trainability of a deep narrow Transformer, against depth", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Encoder-decoder `transformer_tiny` ({task}) on the built-in "
          f"synthetic language pair ({task.min_len}-{task.max_len} source words), trained in plain PyTorch (K=1, "
          f"no pipeline: the engine is not what is tested), Adam (betas 0.9/0.98) lr {setting.lr:g} with "
          f"{setting.warmup} linear warm-up steps, {setting.steps} steps, batch {task.batch_size} sentences: "
          f"{how}. Fresh seeds {seeds}. Post-norm (the paper's baseline) at L = {depths} layers per side; at "
          f"L={depths[-1]} also each fix, and pre-norm with {' / '.join(CONTROL)} (the control). FFN init "
          f"scaling: L^-1/4 (Lingvo's depth^(-1/(2*2))); logit clip threshold t = {clip:g} (the paper gives "
          f"none), in training only. Fixed before any run: {RULES}. Cells are mean [min, max] over seeds; "
          "'logits above t': steps at which some raw logit exceeded t (with a clip: the clip bound; "
          f"'unclipped': it would have). {len(done)} runs, {minutes:.1f} process-minutes.", "",
          md_table(HEADER, table), "", *findings(groups, depths, clip), "", "![loss curves](trainability.png)", ""]
    data = {"setting": vars(setting), "selection": how, "seeds": seeds, "depths": depths, "clip": clip,
            "rules": RULES, "rule": RULE, "verdict": findings(groups, depths, clip)[0],
            "rows": [{"norm": k[0], "variant": k[1], "layers": k[2], "runs": groups[k]} for k in order]}
    path = write(args.out, "trainability.md", "\n".join(md), data)
    log_wandb(args.wandb, args.out, "trainability", {"trainability": (HEADER, table)}, [png])
    print(path)


if __name__ == "__main__":
    run_main(main)

"""Trainability of a deep narrow Transformer (paper §5): FFN init scaling and logit clipping.

    python -m experiments.trainability              # results/trainability.md + trainability.png
    python -m experiments.trainability --tiny --out /tmp/tr
    gpipe-train -m experiment=paper_trainability model.ffn_init_scaling=true,false model.logit_clip=10,null seed=0,1,2
    python -m experiments.trainability --from-multirun logs/train/multiruns/<time>

Four variants (none / FFN init scaling / logit clipping / both) at the configured depth
(``model.num_layers`` per side), and the baseline at every shallower depth of
``experiment.depths`` with the same lr, warm-up and steps (the depth controls), x several
seeds, trained through gpipe-train's path (``Translator`` under ``GPipeStrategy``, K=2 CPU
stages, M=2) on the built-in synthetic translation task. Reports per row the divergences
(judged from step 1), the runs that learn, the early spike, the final loss against the
starting loss and validation NLL (``trainability_lib``), with gradient-norm spikes (> 5x the
median of the previous 10 steps) and non-finite steps (skipped updates). Whether the
paper's claim is reproduced is computed from the numbers. Settings:
``conf/experiment/paper_trainability.yaml`` (model sizes, ``optimizer.lr``, data sizes,
K / M, ``trainer.max_steps`` and the ``experiment`` block: seeds, depths, warm-up, clip threshold).
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/trainability.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import json
import statistics
from pathlib import Path

from experiments.common import RESULTS, configs, log_wandb, parser, run_main, save_figure, write
from experiments.nmt_lib import spikes, train_translation
from experiments.trainability_collect import EXPERIMENT, PAPER_FIX, collected, plot_collected
from experiments.trainability_lib import CELL_HEADER, RULE, cells, depth_verdict, facts, mean_range
from gpipe_lab.bench import Progress
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table

#: ``--tiny``: 2 + 2 layers (and the 1 + 1 control), one seed, 4 steps.
TINY = {EXPERIMENT: ["model.num_layers=2", "model.d_model=16", "model.ffn_dim=32", "trainer.max_steps=4",
                     "optimizer.lr=0.003", "experiment.depths=[1,2]",
                     "experiment.seeds=[0]", "data.num_train=800", "data.num_val=32", "experiment.eval_batches=1"]}
SIZE_KEYS = ("d_model", "ffn_dim", "num_heads", "pre_norm")


def variants(clip: float) -> dict[str, dict]:
    """The four model-option variants; the paper gives no clipping threshold."""
    return {"none": {}, "ffn init scaling": {"ffn_init_scaling": True}, "logit clip": {"logit_clip": clip},
            "both": {"ffn_init_scaling": True, "logit_clip": clip}}


def plot(runs: dict[tuple[str, int], list], deep: int, path: Path) -> Path:
    """Loss curves: the baseline at every depth (left), the four variants at the deepest (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    base = sorted(d for n, d in runs if n == "none")
    for (name, layers), results in runs.items():
        ax, colour, label = ((a, f"C{base.index(layers)}", f"none, L={layers}") if name == "none" and layers != deep
                             else (b, f"C{list(variants(1.0)).index(name)}", f"{name}, L={layers}"))
        for j, r in enumerate(results):
            ax.plot(r.losses, color=colour, alpha=0.7, label=label if j == 0 else None)
    a.set(xlabel="step", ylabel="training loss (token mean)", yscale="log", title="baseline, shallower controls")
    b.set(xlabel="step", yscale="log", title=f"L={deep} per side: the fixes")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def findings(rows: dict[tuple[str, int], list[dict]], deep: int, clip: float, peak: float) -> str:
    """Sentences computed from the runs: the depth verdict, each variant at the deepest depth, the clip."""
    baseline = {d: rs for (n, d), rs in rows.items() if n == "none"}
    ok, reason = depth_verdict(baseline, rows.get(("both", deep)))
    lines = [f"- {'Reproduced here' if ok else 'Not reproduced here'}: {reason} (the claim needs the baseline to "
             "diverge in at least two thirds of its runs at the deepest depth, in none at the two shallowest, and every "
             "run with both fixes to learn)."]
    for name in variants(clip):
        rs = rows[(name, deep)]
        lines.append(f"- {name} at L={deep}: diverged in {sum(r['diverged'] for r in rs)} of {len(rs)}, learns in "
                     f"{sum(r['learns'] for r in rs)} of {len(rs)}, final / start "
                     f"{mean_range([r['final_over_start'] for r in rs])}, early spike "
                     f"{mean_range([r['early_spike'] for r in rs])} x start.")
    lines.append(f"- Largest unclipped logit without the fixes: {peak:.1f}, "
                 f"{'above' if peak > clip else 'never above'} the clip threshold {clip:g}.")
    return "\n".join(lines)


def search_section(path: Path) -> str:
    """The grid ``trainability_search.py`` tried (from its JSON) and its verdict, or nothing."""
    if not path.exists():
        return ""
    from experiments.trainability_search import table

    data = json.loads(path.read_text())
    header, rows = table(data.get("tried", []), tuple(data.get("depths", [])))
    found = data.get("found")
    verdict = (f"Depth effect found: {found['setting']}." if found else
               f"Not reproduced here: none of the {len(rows)} settings tried shows it.")
    return "\n".join(["## The grid searched (`experiments/trainability_search.py`, extended after each miss)", "",
                      md_table(header, rows), "", verdict])


def main() -> None:
    """Train every row and seed; write ``trainability.md`` / ``.json`` / ``.png`` under ``--out``.

    Raises:
        ValueError: a bad override, a depth list not ending at ``model.num_layers``, or a multirun folder
            without paper_trainability jobs.
    """
    p = parser(__doc__.split("\n")[0], [EXPERIMENT], multirun=True)
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (= experiment.seeds=[0,...,N-1])")
    p.add_argument("--steps", type=int, help="= trainer.max_steps")
    p.add_argument("--lr", type=float, help="= optimizer.lr")
    p.add_argument("--logit-clip", type=float, help="= experiment.logit_clip (paper: unstated)")
    p.add_argument("--search", type=Path, default=RESULTS / "trainability_search.json",
                   help="trainability_search.py's JSON, whose grid the file reports (skipped when absent)")
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
    for flag, key in ((args.seeds, "experiment.seeds"), (args.steps, "trainer.max_steps"), (args.lr, "optimizer.lr"),
                      (args.logit_clip, "experiment.logit_clip")):
        if flag is not None:
            args.overrides.append(f"{key}={list(range(flag)) if key == 'experiment.seeds' else flag}")
    cfg = configs(args, [EXPERIMENT], TINY)[EXPERIMENT]
    e, d = cfg.experiment, cfg.data
    seeds, steps, lr, clip = list(e.seeds), int(cfg.trainer.max_steps), float(cfg.optimizer.lr), float(e.logit_clip)
    deep, depths, warmup = int(cfg.model.num_layers), [int(x) for x in e.depths], int(e.warmup)
    if not depths or depths[-1] != deep or depths != sorted(set(depths)):
        raise ValueError(f"experiment.depths={depths} must rise to model.num_layers={deep}")
    size = {k: cfg.model[k] for k in SIZE_KEYS}
    plan = [*((name, deep, options) for name, options in variants(clip).items()),
            *(("none", layers, {}) for layers in reversed(depths[:-1]))]
    runs: dict[tuple[str, int], list] = {}
    progress = Progress(len(plan) * len(seeds), "trainability", note=f"writing to {args.out}")
    for name, layers, options in plan:
        runs[(name, layers)] = []
        for s in seeds:
            runs[(name, layers)].append(train_translation(
                steps, seed=s, lr=lr, warmup=warmup, batch_size=d.batch_size, num_train=d.num_train,
                num_val=d.num_val, partitions=cfg.pipeline.partitions, chunks=cfg.pipeline.chunks,
                eval_batches=e.eval_batches, num_layers=layers, **size, **options))
            progress.done(f"{name}, L={layers}, seed {s}")
    rows = {key: [facts(r, s) for r, s in zip(rs, seeds)] for key, rs in runs.items()}
    header = ["variant", "layers per side", "parameters", *CELL_HEADER, "BLEU", "grad-norm spikes / run",
              "max grad norm", "largest abs logit", "non-finite steps", "paper (§5)"]
    order = sorted(runs, key=lambda k: (-k[1], list(variants(clip)).index(k[0])))
    table = [[name, layers, f"{runs[(name, layers)][0].params:,}", *cells(rows[(name, layers)]),
              mean_range([r["bleu"] for r in rows[(name, layers)]], 3),
              f"{statistics.fmean(spikes(r.grad_norms) for r in runs[(name, layers)]):.1f}",
              f"{max(r['max_grad_norm'] for r in rows[(name, layers)]):.2f}",
              f"{max(r['max_logit'] for r in rows[(name, layers)]):.1f}",
              sum(r["nonfinite"] for r in rows[(name, layers)]), PAPER_FIX[name]] for name, layers in order]
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot({k: runs[k] for k in order}, deep, args.out / "trainability.png")
    peak = max(r["max_logit"] for (n, _), rs in rows.items() if n == "none" for r in rs)
    md = ["# Trainability of a deep narrow Transformer, against depth", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Encoder-decoder `transformer_tiny` with {size}, the four "
          f"variants at L={deep} layers per side and the baseline at L={depths[:-1]} (depth controls: the same "
          f"lr, warm-up and steps), {len(seeds)} seed(s) {seeds} x {steps} steps, Adam lr {lr} with {warmup} "
          f"linear warm-up steps, batch {d.batch_size} sentences, GPipe K={cfg.pipeline.partitions}, "
          f"M={cfg.pipeline.chunks} on CPU; synthetic translation task. Logit clip threshold {clip:g} (the paper "
          "gives none); FFN init scale L^-1/4 (Lingvo's depth^(-1/(2*2))). Cells are mean [min, max] over seeds. "
          f"{RULE}; spikes = gradient norm above 5 x the median of the previous 10 steps; largest abs logit = "
          "the output projection's, before clipping.", "",
          md_table(header, table), "", "![loss curves](trainability.png)", "",
          findings(rows, deep, clip, peak), "", "" if args.tiny else search_section(args.search), ""]
    data = {"depths": depths, "rows": [{"variant": n, "layers": layers, "runs": [
        {**f, "losses": r.losses, "grad_norms": r.grad_norms, "max_logits": r.max_logits}
        for f, r in zip(rows[(n, layers)], runs[(n, layers)])]} for n, layers in order]}
    path = write(args.out, "trainability.md", "\n".join(md), data)
    log_wandb(args.wandb, args.out, "trainability", {"trainability": (header, table)}, [png])
    print(path)


if __name__ == "__main__":
    run_main(main)

"""Trainability of a deep narrow Transformer (paper §5): FFN init scaling and logit clipping.

    python -m experiments.trainability              # results/trainability.md + trainability.png
    python -m experiments.trainability --tiny --out /tmp/tr
    gpipe-train -m experiment=paper_trainability model.ffn_init_scaling=true,false model.logit_clip=10,null seed=0,1,2
    python -m experiments.trainability --from-multirun logs/train/multiruns/<time>

Four variants (none / FFN init scaling / logit clipping / both) x several
seeds, trained through gpipe-train's path (``Translator`` under ``GPipeStrategy``, K=2 CPU stages,
M=2) on the built-in synthetic
translation task with a deliberately aggressive learning rate (no warm-up).
Records loss curves, gradient-norm spikes (> 5x the median of the previous 10
steps), non-finite steps (skipped updates), validation NLL and BLEU. Settings:
``conf/experiment/paper_trainability.yaml`` (model sizes, ``optimizer.lr``, data sizes,
K / M, ``trainer.max_steps`` and the ``experiment`` block: seeds, clip threshold).
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/trainability.py``): rerun as the module
    from gpipe_lab.bench.launch import rerun_as_module

    rerun_as_module(__file__)

import statistics
from pathlib import Path

from experiments.common import RESULTS, configs, log_wandb, parser, provenance, save_figure, write
from experiments.multirun import load_runs, run_dirs_note
from experiments.nmt_lib import diverged, spikes, train_translation
from gpipe_lab.bench import Progress
from gpipe_lab.bench.markdown import md_table

EXPERIMENT = "paper_trainability"
#: ``--tiny``: a 2 + 2-layer model, one seed, 4 steps.
TINY = {EXPERIMENT: ["model.num_layers=2", "model.d_model=16", "model.ffn_dim=32", "trainer.max_steps=4",
                     "optimizer.lr=0.003",
                     "experiment.seeds=[0]", "data.num_train=800", "data.num_val=32", "experiment.eval_batches=1"]}
SIZE_KEYS = ("num_layers", "d_model", "ffn_dim", "num_heads")


def variants(clip: float) -> dict[str, dict]:
    """The four model-option variants; the paper gives no clipping threshold."""
    return {"none": {}, "ffn init scaling": {"ffn_init_scaling": True}, "logit clip": {"logit_clip": clip},
            "both": {"ffn_init_scaling": True, "logit_clip": clip}}


def mean_std(values: list[float]) -> str:
    """``mean ± std`` (std 0 for one value)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {std:.3f}"


def plot(runs: dict[str, list], path: Path) -> Path:
    """Loss and gradient-norm curves (every seed, one colour per variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, results) in enumerate(runs.items()):
        for j, r in enumerate(results):
            a.plot(r.losses, color=f"C{i}", alpha=0.7, label=name if j == 0 else None)
            b.plot(r.grad_norms, color=f"C{i}", alpha=0.7, label=name if j == 0 else None)
    a.set(xlabel="step", ylabel="training loss (token mean)", title="loss")
    b.set(xlabel="step", ylabel="gradient norm", yscale="log", title="gradient norm")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def variant_of(ffn_init_scaling: object, logit_clip: object) -> str:
    """The variant name of a run's two model options."""
    return {(False, False): "none", (True, False): "ffn init scaling", (False, True): "logit clip",
            (True, True): "both"}[(bool(ffn_init_scaling), logit_clip is not None)]


def collected(dirs: list[Path]) -> tuple[list[str], list[list[object]], str, dict]:
    """The variants' table from gpipe-train jobs of ``paper_trainability`` under ``dirs``."""
    runs = load_runs(dirs, [EXPERIMENT])
    groups: dict[str, list] = {}
    for run in runs:
        groups.setdefault(variant_of(run.get("model.ffn_init_scaling"), run.get("model.logit_clip")), []).append(run)
    header = ["variant", "jobs (seeds)", "final train loss", "val loss (token mean)", "BLEU", "non-finite steps",
              "paper (§5)"]
    table = []
    for name in (n for n in ("none", "ffn init scaling", "logit clip", "both") if n in groups):
        rs = groups[name]
        nums = {k: [r.summary[k] for r in rs if r.summary.get(k) is not None]
                for k in ("final_train_loss", "val_loss", "validation_value")}
        raise_policy = all(r.get("pipeline.nonfinite") == "raise" for r in rs)
        table.append([name, f"{len(rs)} ({sorted({r.summary.get('seed') for r in rs})})",
                      *(mean_std(v) if v else "-" for v in nums.values()),
                      "0 (pipeline.nonfinite=raise: one would have stopped the job)" if raise_policy else "-",
                      PAPER_FIX[name]])
    clips = sorted({str(r.get("model.logit_clip")) for r in runs if r.get("model.logit_clip") is not None})
    text = (f"{run_dirs_note(dirs, runs)} Each job: gpipe-train (Lightning, GPipeStrategy), loss/metrics from "
            f"its summary.json; logit clip threshold(s) {', '.join(clips) or '-'}. Gradient norms are not in "
            "summary.json: `python -m experiments.trainability` records them.")
    return header, table, text, {n: [r.summary for r in rs] for n, rs in groups.items()}


def plot_collected(data: dict[str, list[dict]], path: Path) -> Path:
    """Each job's final train loss and validation loss, one column per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, rows in enumerate(data.values()):
        for key, marker in (("final_train_loss", "o"), ("val_loss", "s")):
            ys = [r[key] for r in rows if r.get(key) is not None]
            ax.plot([i] * len(ys), ys, marker, color="C0" if marker == "o" else "C1",
                    label=("train loss" if marker == "o" else "val loss") if i == 0 else None)
    ax.set_xticks(range(len(data)), list(data), fontsize=8)
    ax.set(ylabel="loss (token mean)", title="gpipe-train jobs: final losses per variant")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def findings(runs: dict[str, list], clip: float) -> str:
    """Sentences computed from the runs: divergences per variant, and whether the clip engaged."""
    counts = {n: sum(diverged(r.losses, r.nonfinite_steps) for r in rs) for n, rs in runs.items()}
    seeds = len(runs["none"])
    lines = ["- Diverged runs per variant: " + ", ".join(f"{n} {c} of {seeds}" for n, c in counts.items()) + "."]
    if counts["none"] < 2 or seeds < 3:
        lines.append(f"- The baseline diverged in {counts['none']} of {seeds} seeds: fewer than 2 of 3, so this "
                     "table cannot show that the fixes prevent a divergence.")
    else:
        fixed = [n for n in counts if n != "none" and counts[n] == 0]
        lines.append(f"- The baseline diverged in {counts['none']} of {seeds} seeds; no divergence with: "
                     f"{', '.join(fixed) or 'none of the fixes'}.")
    peak = max(max(r.max_logits, default=0.0) for r in runs["none"])
    lines.append(f"- Largest unclipped logit without the fixes: {peak:.1f}, "
                 f"{'above' if peak > clip else 'never above'} the clip threshold {clip:g}.")
    return "\n".join(lines)


def search_section(path: Path) -> str:
    """The settings ``trainability_search.py`` tried (from its JSON) and its verdict, or nothing."""
    if not path.exists():
        return ""
    import json

    data = json.loads(path.read_text())
    tried = data.get("tried", [])
    rows = [[t["setting"], f"{t['diverged']} / {len(t['runs'])}"] for t in tried]
    found = data.get("found")
    verdict = (f"Diverging setting found: {found['setting']}." if found else
               f"None of the {len(tried)} settings tried diverged in >= 2 of 3 seeds.")
    return "\n".join(["## Where the baseline was tried (`experiments/trainability_search.py`)", "",
                      md_table(["baseline setting", "diverged / seeds"], rows), "", verdict])


PAPER_FIX = {"none": "-", "ffn init scaling": "(i) scale down FFN init by the number of layers",
             "logit clip": "(ii) clip logits above a magnitude", "both": "(i) + (ii), used for the deep models"}


def main() -> None:
    """Train every variant and seed; write ``trainability.md`` / ``.json`` / ``.png`` under ``--out``.

    Raises:
        ValueError: a bad override, or a multirun folder without paper_trainability jobs.
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
    size = {k: cfg.model[k] for k in SIZE_KEYS}
    runs: dict[str, list] = {}
    progress = Progress(len(variants(clip)) * len(seeds), "trainability", note=f"writing to {args.out}")
    for name, options in variants(clip).items():
        runs[name] = []
        for s in seeds:
            runs[name].append(train_translation(
                steps, seed=s, lr=lr, batch_size=d.batch_size, num_train=d.num_train, num_val=d.num_val,
                partitions=cfg.pipeline.partitions, chunks=cfg.pipeline.chunks, eval_batches=e.eval_batches,
                **size, **options))
            progress.done(f"{name}, seed {s}")
    header = ["variant", "diverged / seeds", "final train loss (last 10 steps)", "val NLL", "BLEU",
              "grad-norm spikes / run", "max grad norm", "largest abs logit", "non-finite steps"]
    table = []
    for name, results in runs.items():
        table.append([name, f"{sum(diverged(r.losses, r.nonfinite_steps) for r in results)} / {len(results)}",
                      mean_std([statistics.fmean(r.losses[-10:]) for r in results]),
                      mean_std([r.val_nll for r in results]), mean_std([r.bleu for r in results]),
                      f"{statistics.fmean(spikes(r.grad_norms) for r in results):.1f}",
                      f"{max(max(r.grad_norms) for r in results):.2f}",
                      f"{max(max(r.max_logits, default=0.0) for r in results):.1f}",
                      sum(r.nonfinite_steps for r in results)])
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(runs, args.out / "trainability.png")
    params = runs["none"][0].params
    md = ["# Trainability of a deep narrow Transformer", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Encoder-decoder `transformer_tiny` with {size} "
          f"({params:,} parameters), {len(seeds)} seed(s) {seeds} x {steps} steps, Adam lr {lr} without warm-up, "
          f"batch {d.batch_size} sentences, GPipe K={cfg.pipeline.partitions}, M={cfg.pipeline.chunks} on CPU; "
          f"synthetic translation task. Logit clip threshold {clip:g} (the paper gives none); FFN init scale "
          "L^-1/4 (Lingvo's depth^(-1/(2*2))). Diverged = a non-finite step or a loss above 1.5 x the lowest "
          "so far after step 10; spikes = gradient norm above 5 x the median of the previous 10 steps; "
          "largest abs logit = the output projection's, before clipping.", "",
          md_table(header, table), "", "![loss and gradient norm](trainability.png)", "",
          findings(runs, clip), "", "" if args.tiny else search_section(args.search), ""]
    data = {n: [{"losses": r.losses, "grad_norms": r.grad_norms, "nonfinite": r.nonfinite_steps,
                 "val_nll": r.val_nll, "bleu": r.bleu, "max_logits": r.max_logits,
                 "diverged": diverged(r.losses, r.nonfinite_steps)} for r in rs] for n, rs in runs.items()}
    path = write(args.out, "trainability.md", "\n".join(md), data)
    log_wandb(args.wandb, args.out, "trainability", {"trainability": (header, table)}, [png])
    print(path)


if __name__ == "__main__":
    main()

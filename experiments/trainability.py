"""Trainability of a deep narrow Transformer (paper §5): FFN init scaling and logit clipping.

    python experiments/trainability.py              # results/trainability.md + trainability.png
    python experiments/trainability.py --tiny --out /tmp/tr

Four variants (none / FFN init scaling / logit clipping / both) x several
seeds, trained through GPipe (K=2 CPU stages, M=2) on the built-in synthetic
translation task with a deliberately aggressive learning rate (no warm-up).
Records loss curves, gradient-norm spikes (> 5x the median of the previous 10
steps), non-finite steps (skipped updates), validation NLL and BLEU.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log_wandb, md_table, parser, provenance, write  # noqa: E402
from nmt_lib import spikes, train_translation  # noqa: E402


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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    """Train every variant and seed; write ``trainability.md`` / ``.json`` / ``.png`` under ``--out``."""
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--logit-clip", type=float, default=10.0, help="clipping threshold |logit| (paper: unstated)")
    args = p.parse_args()
    seeds, steps = (1, 4) if args.tiny else (args.seeds, args.steps)
    size = dict(num_layers=2, d_model=16, ffn_dim=32, num_heads=2) if args.tiny else dict(
        num_layers=12, d_model=32, ffn_dim=128, num_heads=2)
    runs: dict[str, list] = {}
    for name, options in variants(args.logit_clip).items():
        runs[name] = [train_translation(steps, seed=s, lr=args.lr, batch_size=32, num_train=800 if args.tiny
                                        else 3000, num_val=32 if args.tiny else 128,
                                        eval_batches=1 if args.tiny else 4, **size, **options)
                      for s in range(seeds)]
    header = ["variant", "final train loss (last 10 steps)", "val NLL", "BLEU", "grad-norm spikes / run",
              "max grad norm", "non-finite steps"]
    table = []
    for name, results in runs.items():
        table.append([name, mean_std([statistics.fmean(r.losses[-10:]) for r in results]),
                      mean_std([r.val_nll for r in results]), mean_std([r.bleu for r in results]),
                      f"{statistics.fmean(spikes(r.grad_norms) for r in results):.1f}",
                      f"{max(max(r.grad_norms) for r in results):.2f}",
                      sum(r.nonfinite_steps for r in results)])
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(runs, args.out / "trainability.png")
    nonfinite = sum(r.nonfinite_steps for rs in runs.values() for r in rs)
    best = min(runs, key=lambda n: statistics.fmean(r.val_nll for r in runs[n]))
    params = runs["none"][0].params
    same = all(a.losses == b.losses for a, b in zip(runs["none"], runs["logit clip"]))
    clip_line = (f"- Logit clipping at {args.logit_clip:g} never engaged: its runs are bit-identical to the unclipped ones "
                 "(same losses at every step), so at this scale it can neither help nor hurt."
                 if same else "- Logit clipping engaged (its loss curves differ from the unclipped runs).")
    md = ["# Trainability of a deep narrow Transformer", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Encoder-decoder `transformer_tiny` with {size} "
          f"({params:,} parameters), {seeds} seed(s) x {steps} steps, Adam lr {args.lr} without warm-up, "
          f"batch 32 sentences, GPipe K=2, M=2 on CPU; synthetic translation task. Logit clip threshold {args.logit_clip:g} "
          "(the paper gives none); FFN init scale L^-1/4 (Lingvo's depth^(-1/(2*2))).", "",
          md_table(header, table), "", "![loss and gradient norm](trainability.png)", "",
          "## What reproduces at this scale", "",
          f"- Non-finite steps across all runs: {nonfinite}. "
          + ("The paper's failure mode (non-finite or huge gradients after a few thousand steps "
             "on noisy data at billions of parameters) does not appear in these minutes-long runs, so this "
             "experiment cannot show that the fixes prevent it."
             if nonfinite == 0 else "Some runs produced non-finite steps; see which variants above."),
          f"- Lowest validation NLL: **{best}**. Differences smaller than the seed spread (±) are not "
          "evidence either way.",
          clip_line,
          "- The paper introduces both as fixes for the stability of very deep, billion-parameter models; "
          "compare each variant's NLL and gradient norms with the seed spread; the instability they "
          "target is out of reach of a minutes-long CPU run.", ""]
    data = {n: [{"losses": r.losses, "grad_norms": r.grad_norms, "nonfinite": r.nonfinite_steps,
                 "val_nll": r.val_nll, "bleu": r.bleu} for r in rs] for n, rs in runs.items()}
    path = write(args.out, "trainability.md", "\n".join(md), data)
    log_wandb(args.wandb, args.out, "trainability", {"trainability": (header, table)}, [png])
    print(path)


if __name__ == "__main__":
    main()

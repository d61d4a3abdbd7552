"""The trainability table from ``gpipe-train -m experiment=paper_trainability`` job folders.

``collected`` groups the jobs by variant (FFN init scaling, logit clip) and layers per
side, and tabulates each group's final train loss, validation loss and BLEU (mean ± std)
from the jobs' summary.json; ``plot_collected`` draws each job's final losses.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.common import save_figure
from experiments.multirun import load_runs, run_dirs_note

EXPERIMENT = "paper_trainability"
PAPER_FIX = {"none": "-", "ffn init scaling": "(i) scale down FFN init by the number of layers",
             "logit clip": "(ii) clip logits above a magnitude", "both": "(i) + (ii), used for the deep models"}


def mean_std(values: list[float]) -> str:
    """``mean ± std`` (std 0 for one value)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {std:.3f}"


def variant_of(ffn_init_scaling: object, logit_clip: object) -> str:
    """The variant name of a run's two model options."""
    return {(False, False): "none", (True, False): "ffn init scaling", (False, True): "logit clip",
            (True, True): "both"}[(bool(ffn_init_scaling), logit_clip is not None)]


def collected(dirs: list[Path]) -> tuple[list[str], list[list[object]], str, dict]:
    """The variants' table from gpipe-train jobs of ``paper_trainability`` under ``dirs``."""
    runs = load_runs(dirs, [EXPERIMENT])
    groups: dict[tuple[str, int], list] = {}
    for run in runs:
        key = (variant_of(run.get("model.ffn_init_scaling"), run.get("model.logit_clip")),
               int(run.get("model.num_layers") or 0))
        groups.setdefault(key, []).append(run)
    order = ("none", "ffn init scaling", "logit clip", "both")
    header = ["variant", "layers per side", "jobs (seeds)", "final train loss", "val loss (token mean)", "BLEU", "non-finite steps",
              "paper (§5)"]
    table = []
    for name, layers in sorted(groups, key=lambda k: (-k[1], order.index(k[0]))):
        rs = groups[(name, layers)]
        nums = {k: [r.summary[k] for r in rs if r.summary.get(k) is not None]
                for k in ("final_train_loss", "val_loss", "validation_value")}
        raise_policy = all(r.get("pipeline.nonfinite") == "raise" for r in rs)
        table.append([name, layers, f"{len(rs)} ({sorted({r.summary.get('seed') for r in rs})})",
                      *(mean_std(v) if v else "-" for v in nums.values()),
                      "0 (pipeline.nonfinite=raise: one would have stopped the job)" if raise_policy else "-",
                      PAPER_FIX[name]])
    clips = sorted({str(r.get("model.logit_clip")) for r in runs if r.get("model.logit_clip") is not None})
    text = (f"{run_dirs_note(dirs, runs)} Each job: gpipe-train (Lightning, GPipeStrategy), loss/metrics from "
            f"its summary.json; logit clip threshold(s) {', '.join(clips) or '-'}. Gradient norms are not in "
            "summary.json: `python -m experiments.trainability` records them.")
    return header, table, text, {f"{n}, L={d}": [r.summary for r in rs] for (n, d), rs in groups.items()}


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

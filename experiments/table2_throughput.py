"""Table 2: normalized training throughput against K and M, beside the paper (TPU).

    python experiments/table2_throughput.py              # results/table2_throughput.md (+ .png)
    python experiments/table2_throughput.py --tiny --out /tmp/t2

K = 1, 2 run for real on CPU stages (GPipe, one thread per stage, local
transport). K = 4, 8 cannot run in parallel on 2 cores: they are predicted by
the planner's simulator from per-layer forward / backward / recompute times
measured here on one thread at the same micro-batch size, summed over the
balance the engine gets (by per-layer FLOPs, as Lingvo), with the stage hand-over
delay measured at K = 2. On a machine with K GPUs the same engine measures
every K: ``--gpu`` measures each K with ``cuda:0..K-1`` (not exercised here: no GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log_wandb, md_table, parser, provenance, write  # noqa: E402
from throughput_lib import Workload, run_grid  # noqa: E402

PAPER = {  # (model, M) -> K=2, K=4, K=8
    ("amoeba", 1): (1, 1.13, 1.38), ("amoeba", 4): (1.07, 1.26, 1.72), ("amoeba", 32): (1.21, 1.84, 3.48),
    ("transformer", 1): (1, 1.07, 1.3), ("transformer", 4): (1.7, 3.2, 4.8), ("transformer", 32): (1.8, 3.4, 6.3)}
NAMES = {"amoeba": "AmoebaNet-D(18, 256)", "transformer": "Transformer-48"}


def workloads(tiny: bool) -> list[Workload]:
    """CPU-sized analogues of AmoebaNet-D(18, 256) and Transformer-48 (48 Transformer-L layers)."""
    if tiny:
        return [Workload("amoeba", "amoebanet_d", dict(num_layers=3, num_filters=8, image_size=32,
                                                       num_classes=10), 64),
                Workload("transformer", "transformer_l", dict(num_layers=8, d_model=32, ffn_dim=64, num_heads=2,
                                                              vocab_size=64, seq_len=8, dropout=0.0), 32)]
    return [Workload("amoeba", "amoebanet_d", dict(num_layers=18, num_filters=16, image_size=32,
                                                   num_classes=10), 64),
            Workload("transformer", "transformer_l", dict(num_layers=48, d_model=64, ffn_dim=256, num_heads=4,
                                                          vocab_size=512, seq_len=32, dropout=0.0), 64)]


def normalized(rows: list[dict], key: str) -> dict[tuple[str, int, int], float]:
    """samples/s of every (workload, K, M) divided by that workload's K=2, M=1."""
    base = {r["workload"]: r[key] for r in rows if r["K"] == 2 and r["M"] == 1 and r[key]}
    return {(r["workload"], r["K"], r["M"]): r[key] / base[r["workload"]] for r in rows
            if r[key] and r["workload"] in base}


def plot(rows: list[dict], path: Path, ms: list[int], ks: list[int]) -> Path:
    """Normalized throughput against M, one line per K (ours) with the paper's dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meas, sim = normalized(rows, "measured_sps"), normalized(rows, "simulated_sps")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, NAMES):
        for i, k in enumerate(ks):
            color = f"C{i}"
            ours = [meas.get((name, k, m), sim.get((name, k, m))) for m in ms]
            kind = "measured" if (name, k, ms[0]) in meas else "simulated"
            ax.plot(ms, ours, "o-", color=color, label=f"K={k} ours ({kind})")
            ax.plot(ms, [PAPER[(name, m)][i] for m in ms], "s--", color=color, alpha=0.6, label=f"K={k} paper")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("throughput / (K=2, M=1)")
        ax.set_title(NAMES[name] + " (ours: CPU analogue)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    """Measure, simulate, and write ``table2_throughput.md`` / ``.json`` / ``.png`` under ``--out``."""
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="measure every K with enough CUDA GPUs (cuda:0..K-1)")
    args = p.parse_args()
    ms, ks = [1, 4, 32], [2, 4, 8]
    steps, repeat = (1, 1) if args.tiny else (3, 3)
    rows = []
    for work in workloads(args.tiny):
        rows += run_grid(work, [1, 2], [4, 8], ms, steps, repeat, args.gpu)
    meas, sim = normalized(rows, "measured_sps"), normalized(rows, "simulated_sps")
    header = ["model (ours)", "M", "K=2 measured", "K=2 simulated", "K=4 simulated", "K=8 simulated",
              "paper K=2", "paper K=4", "paper K=8"]
    table = []
    for work in workloads(args.tiny):
        for m in ms:
            p = PAPER[(work.label, m)]
            keys = [(work.label, k, m) for k in ks]
            table.append([f"{NAMES[work.label]} analogue", m, f"{meas[keys[0]]:.2f}", f"{sim[keys[0]]:.2f}",
                          *(f"{meas[key]:.2f} (measured)" if key in meas else f"{sim[key]:.2f}"
                            for key in keys[1:]), *p])
    v_header = ["model", "K", "M", "balance", "measured s/step", "simulated s/step", "error",
                "measured bubble", "simulated bubble", "theory (K-1)/(M+K-1)"]
    validation = [[r["workload"], r["K"], r["M"], r["balance"], f"{r['measured_s']:.3f}",
                   f"{r['simulated_s']:.3f}", f"{(r['simulated_s'] - r['measured_s']) / r['measured_s']:+.1%}",
                   f"{r['measured_bubble']:.3f}", f"{r['simulated_bubble']:.3f}",
                   f"{(r['K'] - 1) / (r['M'] + r['K'] - 1):.3f}"] for r in rows if r["measured_s"]]
    png = plot(rows, args.out / "table2_throughput.png", ms, ks) if args.out.mkdir(
        parents=True, exist_ok=True) is None else None
    sizes = "; ".join(f"{w.label}: `{w.preset}` {w.sizes}, mini-batch {w.batch}" for w in workloads(args.tiny))
    md = ["# Table 2 — normalized training throughput (K partitions, M micro-batches)", "", provenance(), "",
          f"{'TINY smoke run. ' if args.tiny else ''}Throughput = samples/s, normalized to K=2, M=1 of the "
          "same kind (measured / simulated). Ours: CPU analogues at sizes this 2-core CPU can run "
          f"({sizes}); fixed mini-batch for every M; checkpoint `except_last`. K=2 measured on two CPU "
          "stages with one thread each (wall-clock: rerun on a quiet "
          "machine before quoting); K=4, 8 simulated from per-layer times.", "",
          md_table(header, table), "", "![throughput vs M](table2_throughput.png)", "",
          "## Simulator validation: measured vs simulated step time", "",
          md_table(v_header, validation), ""]
    md += [Path(__file__).with_name("throughput_notes.md").read_text()] if not args.tiny else []
    data = [{k: v for k, v in r.items() if "timeline" not in k} for r in rows]
    path = write(args.out, "table2_throughput.md", "\n".join(md), data)
    log_wandb(args.wandb, args.out, "table2_throughput", {"throughput": (header, table),
                                                          "validation": (v_header, validation)}, [png])
    print(path)


if __name__ == "__main__":
    main()

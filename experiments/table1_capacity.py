"""Table 1: the largest AmoebaNet-D and Transformer-L that fit, beside the paper.

    python -m experiments.table1_capacity            # results/table1_capacity.md (about a minute)
    python -m experiments.table1_capacity --tiny --out /tmp/t1
    python -m experiments.table1_capacity experiment.amoebanet.memory_gib=16   # any config key

Everything is planned on the meta device with ``gpipe_lab.planner.capacity``:
parameter counts are exact, activation bytes are what PyTorch's autograd saves.
The settings (columns [K, L, D], memory, bytes per parameter, batch, micro-batches,
search range) are the ``experiment`` block of ``conf/experiment/paper_table1_capacity.yaml``.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python experiments/table1_capacity.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

from pathlib import Path

from omegaconf import DictConfig

from experiments.common import configs, fmt_bytes, fmt_count, log_wandb, parser, save_figure, write
from gpipe_lab.bench import Progress
from gpipe_lab.bench.machine import provenance
from gpipe_lab.bench.markdown import md_table
from gpipe_lab.planner.capacity import GiB, Plan, best_plan, largest
from gpipe_lab.planner.memory import layer_records

EXPERIMENT = "paper_table1_capacity"
#: ``--tiny``: toy sizes (3-cell AmoebaNets, 8-layer Transformers on at most 4 partitions).
TINY = {EXPERIMENT: [
    "experiment.amoebanet.image_size=32", "experiment.amoebanet.batch=8", "experiment.amoebanet.search_step=8",
    "experiment.amoebanet.search_upper=64", "experiment.transformer.seq_len=64", "experiment.transformer.batch=4",
    "experiment.transformer.search_upper=64", "experiment.microbatch_sweep=[1,8]",
    "experiment.amoebanet.columns={Naive-1:[1,3,8],Pipeline-1:[1,3,8],Pipeline-2:[2,3,16],Pipeline-4:[4,3,16],"
    "Pipeline-8:[8,3,16]}",
    "experiment.transformer.columns={Naive-1:[1,3],Pipeline-1:[1,8],Pipeline-8:[4,8],Pipeline-32:[4,8],"
    "Pipeline-128:[4,8]}"]}

AMOEBA_PAPER = {  # column: (K, L, D, params, param memory, peak activation) as printed
    "Naive-1": (1, 18, 208, "82M", "1.05GB", "6.26GB"), "Pipeline-1": (1, 18, 416, "318M", "3.8GB", "3.46GB"),
    "Pipeline-2": (2, 18, 544, "542M", "6.45GB", "8.11GB"),
    "Pipeline-4": (4, 36, 544, "1.05B", "12.53GB", "15.21GB"),
    "Pipeline-8": (8, 72, 512, "1.8B", "24.62GB", "26.24GB")}
TRANSFORMER_PAPER = {  # column: (K, layers, params, param memory, peak activation)
    "Naive-1": (1, 3, "282.2M", "11.7G", "3.15G"), "Pipeline-1": (1, 13, "785.8M", "8.8G", "6.4G"),
    "Pipeline-8": (8, 103, "5.3B", "59.5G", "50.9G"), "Pipeline-32": (32, 415, "21.0B", "235.1G", "199.9G"),
    "Pipeline-128": (128, 1663, "83.9B", "937.9G", "796.1G")}


def column(block: DictConfig, name: str, paper: dict, width: int) -> list[int]:
    """The config's ``[K, L(, D)]`` of paper column ``name``.

    Raises:
        ValueError: a column the paper does not have, or not ``width`` integers.
    """
    if name not in paper:
        raise ValueError(f"experiment.*.columns: unknown column {name!r}; allowed: {', '.join(paper)}")
    value = list(block.columns[name])
    if len(value) != width or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"experiment.*.columns.{name}: expected {width} positive integers, got {value}")
    return value


def amoeba_plan(a: DictConfig, L: int, D: int, k: int, micro: int, remat: bool, scale: float = 1.0) -> Plan:
    """The best ``k``-way plan of AmoebaNet-D(L, D) under block ``a``'s memory and batch."""
    recs = layer_records(a.family, num_layers=L, num_filters=D, image_size=a.image_size)
    return best_plan(recs, k, a.memory_gib * GiB, a.batch, micro, remat, a.bytes_per_param, scale)


def largest_filters(a: DictConfig, L: int, k: int, micro: int, remat: bool, scale: float = 1.0) -> int:
    """Largest D (a multiple of ``a.search_step``) such that AmoebaNet-D(L, D) fits (0 if none)."""
    step = a.search_step
    return largest(lambda u: amoeba_plan(a, L, u * step, k, micro, remat, scale).fits, a.search_upper // step) * step


def amoebanet_table(a: DictConfig, counts: dict | None = None) -> tuple[list[str], list[list[str]]]:
    """Rows of the AmoebaNet half (paper config, ours at that config, our largest); ``counts`` (if given)
    receives column -> (ours at the paper's config, our largest) parameter counts."""
    header = [f"{a.memory_gib:g} GiB accelerators", *a.columns]
    rows: dict[str, list[str]] = {k: [] for k in (
        "paper (L, D)", "paper # params", "ours # params (exact count)", "paper param memory",
        f"ours param memory ({a.bytes_per_param:g} B/param, GiB)", "paper peak activation",
        "ours peak activation, sum (max/stage)",
        "ours: paper config fits?", "ours largest D at the paper's L (fp32 act.)", "  its # params",
        "ours largest D at the paper's L (bf16 act.)", "ours largest D at the paper's L (fp32, M = N/4)")}
    for col in a.columns:
        k, L, D = column(a, col, AMOEBA_PAPER, 3)
        pk, pL, pD, p_params, p_mem, p_act = AMOEBA_PAPER[col]
        naive = col.startswith("Naive")
        micro, remat = (1, False) if naive else (a.microbatches or a.batch, True)
        plan = amoeba_plan(a, L, D, k, micro, remat)
        best, best16 = largest_filters(a, L, k, micro, remat), largest_filters(a, L, k, micro, remat, 0.5)
        quarter = largest_filters(a, L, k, micro if naive else a.batch // 4, remat)
        best_params = sum(r.params for r in layer_records(
            a.family, num_layers=L, num_filters=best, image_size=a.image_size)) if best else 0
        acts = [p.activation_bytes for p in plan.partitions]
        if counts is not None:
            counts[col] = (plan.params, best_params)
        planned = "" if (k, L, D) == (pk, pL, pD) else f" (planned: K={k}, ({L}, {D}))"
        for key, value in zip(rows, (
                f"({pL}, {pD}){planned}", p_params, f"{plan.params:,} ({fmt_count(plan.params)})", p_mem,
                fmt_bytes(sum(p.parameter_bytes for p in plan.partitions)), p_act,
                f"{fmt_bytes(sum(acts))} ({fmt_bytes(max(acts))})",
                f"{'yes' if plan.fits else 'no'} ({fmt_bytes(plan.peak_bytes)} peak)",
                f"({L}, {best})", fmt_count(best_params), f"({L}, {best16})",
                "-" if naive else f"({L}, {quarter})")):
            rows[key].append(value)
    return header, [[k, *v] for k, v in rows.items()]


def transformer_plan(t: DictConfig, layers: int, k: int, micro: int, remat: bool, scale: float = 1.0) -> Plan | None:
    """The best ``k``-way plan of a ``layers``-layer Transformer-L, or None with fewer layers than K."""
    recs = layer_records(t.family, num_layers=layers, seq_len=t.seq_len)
    if len(recs) < k:
        return None
    return best_plan(recs, k, t.memory_gib * GiB, t.batch, micro, remat, t.bytes_per_param, scale)


def most_layers(t: DictConfig, k: int, micro: int, remat: bool, scale: float = 1.0) -> int:
    """Most layers of Transformer ``t.family`` whose best ``k``-way plan fits (0 if none)."""
    def fits(n: int) -> bool:
        found = transformer_plan(t, n, k, micro, remat, scale)
        return found is not None and found.fits
    return largest(fits, t.search_upper)


def transformer_table(t: DictConfig, counts: dict | None = None) -> tuple[list[str], list[list[str]]]:
    """Rows of the Transformer-L half; ``counts`` as in ``amoebanet_table``."""
    header = [f"{t.memory_gib:g} GiB accelerators", *t.columns]
    rows: dict[str, list[str]] = {k: [] for k in (
        "paper layers", "paper # params", "ours # params (exact count)", "paper param memory",
        f"ours param memory ({t.bytes_per_param:g} B/param, GiB)", "paper peak activation",
        "ours peak activation, sum (max/stage)",
        "ours: paper config fits?", "ours largest (fp32 act.) layers", "  its # params",
        "ours largest (bf16 act.) layers", "ours largest (fp32, M = N/4) layers")}
    for col in t.columns:
        k, layers = column(t, col, TRANSFORMER_PAPER, 2)
        pk, p_layers, p_params, p_mem, p_act = TRANSFORMER_PAPER[col]
        naive = col.startswith("Naive")
        micro, remat = (1, False) if naive else (t.microbatches or t.batch, True)
        plan = transformer_plan(t, layers, k, micro, remat)
        assert plan is not None, f"{col}: {layers} layers cannot be cut into {k} partitions"
        best, best16 = most_layers(t, k, micro, remat), most_layers(t, k, micro, remat, 0.5)
        quarter = most_layers(t, k, micro if naive else t.batch // 4, remat)
        best_params = sum(r.params for r in layer_records(t.family, num_layers=best, seq_len=t.seq_len)) if best else 0
        acts = [p.activation_bytes for p in plan.partitions]
        if counts is not None:
            counts[col] = (plan.params, best_params)
        planned = "" if (k, layers) == (pk, p_layers) else f" (planned: {layers}, K={k})"
        for key, value in zip(rows, (
                f"{p_layers}{planned}", p_params, f"{plan.params:,} ({fmt_count(plan.params)})", p_mem,
                fmt_bytes(sum(p.parameter_bytes for p in plan.partitions)), p_act,
                f"{fmt_bytes(sum(acts))} ({fmt_bytes(max(acts))})",
                f"{'yes' if plan.fits else 'no'} ({fmt_bytes(plan.peak_bytes)} peak)",
                best, fmt_count(best_params) if best else "-", best16, "-" if naive else quarter)):
            rows[key].append(value)
    return header, [[k, *v] for k, v in rows.items()]


def microbatch_sensitivity(a: DictConfig, ms: list[int]) -> tuple[list[str], list[list[str]]]:
    """Peak activation (sum over stages) of the Pipeline-k AmoebaNet columns against M."""
    header = ["config", *(f"M={m}" for m in ms), "paper"]
    rows = []
    for col in a.columns:
        if col.startswith("Naive"):
            continue
        k, L, D = column(a, col, AMOEBA_PAPER, 3)
        acts = [sum(p.activation_bytes for p in amoeba_plan(a, L, D, k, m, True).partitions) for m in ms]
        rows.append([f"{col} ({L}, {D})", *(fmt_bytes(x) for x in acts), AMOEBA_PAPER[col][-1]])
    return header, rows


def count(text: str) -> float:
    """'82M' / '1.05B' -> a number."""
    return float(text[:-1]) * {"M": 1e6, "B": 1e9}[text[-1]]


def plot(amoeba: dict, transformer: dict, path: Path) -> Path:
    """Parameters per column: the paper's, ours at the paper's config, our largest that fits (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, ours, paper, field) in zip(axes, (
            ("AmoebaNet-D", amoeba, AMOEBA_PAPER, 3), ("Transformer-L", transformer, TRANSFORMER_PAPER, 2))):
        cols = list(ours)
        x = range(len(cols))
        for i, (label, values) in enumerate((
                ("paper", [count(paper[c][field]) for c in cols]), ("ours at the config", [ours[c][0] for c in cols]),
                ("ours: largest that fits", [ours[c][1] for c in cols]))):
            ax.bar([v + (i - 1) * 0.27 for v in x], values, width=0.27, label=label)
        ax.set_xticks(list(x), cols, fontsize=8)
        ax.set(yscale="log", ylabel="# parameters", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def main() -> None:
    """Regenerate ``table1_capacity.md`` (+ ``.json``) under ``--out``.

    Raises:
        ValueError: an unknown column or a bad override (naming it).
    """
    args = parser(__doc__.split("\n")[0], [EXPERIMENT]).parse_args()
    cfg = configs(args, [EXPERIMENT], TINY)[EXPERIMENT].experiment
    a, t = cfg.amoebanet, cfg.transformer
    a_counts: dict = {}
    t_counts: dict = {}
    progress = Progress(3, "table1_capacity", note=f"writing to {args.out}")
    a_head, a_rows = amoebanet_table(a, a_counts)
    progress.done("AmoebaNet-D columns")
    t_head, t_rows = transformer_table(t, t_counts)
    progress.done("Transformer-L columns")
    ms = sorted({*cfg.microbatch_sweep})
    m_head, m_rows = microbatch_sensitivity(a, [m for m in ms if a.batch % m == 0])
    progress.done("micro-batch sensitivity")
    a_micro = a.microbatches or a.batch
    t_micro = t.microbatches or t.batch
    md = [
        "# Table 1 — the largest model that fits (planned on the meta device)", "", provenance(), "",
        f"{'TINY smoke run (toy sizes, not the paper configs). ' if args.tiny else ''}"
        "Paper columns copied from the paper as printed; ours computed by `gpipe_lab.planner.capacity` "
        "from activation shapes measured on the meta device (saved-tensor hooks), float32, "
        f"PyTorch eager. Memory in GiB (2^30 bytes); accelerators modelled as exactly {a.memory_gib:g} / "
        f"{t.memory_gib:g} GiB. Settings: `conf/experiment/{EXPERIMENT}.yaml`.", "",
        f"## AmoebaNet-D, {a.image_size}x{a.image_size}, mini-batch {a.batch}, RMSProp ({a.bytes_per_param:g} B/param)", "",
        f"Naive-1: one device, no re-materialization, whole batch. Pipeline-k: k partitions, "
        f"re-materialization, M = {a_micro} micro-batches"
        f"{' (one image each, as torchgpipe' + chr(39) + 's memory benchmark)' if a_micro == a.batch else ''}; "
        "balance chosen to minimise the largest partition.", "",
        md_table(a_head, a_rows), "",
        f"## Transformer-L (d 2048, FFN 8192, 32 heads, vocab 32k), seq {t.seq_len}, batch {t.batch}", "",
        f"Pipeline-k: M = {t_micro} micro-batches{' (one sequence each)' if t_micro == t.batch else ''}. "
        "The paper's Naive-1 memory cells look swapped (282.2M x 12 B = 3.15 GiB is the parameter memory).", "",
        md_table(t_head, t_rows), "",
        "## Peak activation of the paper's Pipeline-k AmoebaNet configs against M (sum over stages)", "",
        md_table(m_head, m_rows), "", "![parameters per column](table1_capacity.png)", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(a_counts, t_counts, args.out / "table1_capacity.png")
    path = write(args.out, "table1_capacity.md", "\n".join(md),
                 {"amoebanet": [a_head, *a_rows], "transformer": [t_head, *t_rows],
                  "microbatches": [m_head, *m_rows]})
    log_wandb(args.wandb, args.out, "table1_capacity",
              {"amoebanet": (a_head, a_rows), "transformer": (t_head, t_rows), "microbatches": (m_head, m_rows)}, [png])
    print(path)


if __name__ == "__main__":
    main()

"""Table 1: the largest AmoebaNet-D and Transformer-L that fit, beside the paper.

    python experiments/table1_capacity.py            # results/table1_capacity.md (about a minute)
    python experiments/table1_capacity.py --tiny --out /tmp/t1

Everything is planned on the meta device with ``gpipe_lab.planner.capacity``:
parameter counts are exact, activation bytes are what PyTorch's autograd saves.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_bytes, fmt_count, log_wandb, md_table, parser, provenance, write  # noqa: E402

from gpipe_lab.planner.capacity import (  # noqa: E402
    GiB,
    best_plan,
    layer_records,
    max_amoebanet_filters,
    max_transformer_layers,
)

AMOEBA_PAPER = {  # column: (K, L, D, params, param memory, peak activation) as printed
    "Naive-1": (1, 18, 208, "82M", "1.05GB", "6.26GB"), "Pipeline-1": (1, 18, 416, "318M", "3.8GB", "3.46GB"),
    "Pipeline-2": (2, 18, 544, "542M", "6.45GB", "8.11GB"),
    "Pipeline-4": (4, 36, 544, "1.05B", "12.53GB", "15.21GB"),
    "Pipeline-8": (8, 72, 512, "1.8B", "24.62GB", "26.24GB")}
TRANSFORMER_PAPER = {  # column: (K, layers, params, param memory, peak activation)
    "Naive-1": (1, 3, "282.2M", "11.7G", "3.15G"), "Pipeline-1": (1, 13, "785.8M", "8.8G", "6.4G"),
    "Pipeline-8": (8, 103, "5.3B", "59.5G", "50.9G"), "Pipeline-32": (32, 415, "21.0B", "235.1G", "199.9G"),
    "Pipeline-128": (128, 1663, "83.9B", "937.9G", "796.1G")}


def amoebanet_table(image: int, batch: int, memory: float, tiny: bool) -> tuple[list[str], list[list[str]]]:
    """Rows of the AmoebaNet half (paper config, ours at that config, our largest)."""
    header = ["8 GiB accelerators", *AMOEBA_PAPER]
    rows: dict[str, list[str]] = {k: [] for k in (
        "paper (L, D)", "paper # params", "ours # params (exact count)", "paper param memory",
        "ours param memory (12 B/param, GiB)", "paper peak activation", "ours peak activation, sum (max/stage)",
        "ours: paper config fits?", "ours largest D at the paper's L (fp32 act.)", "  its # params",
        "ours largest D at the paper's L (bf16 act.)", "ours largest D at the paper's L (fp32, M = N/4)")}
    for col, (k, L, D, p_params, p_mem, p_act) in AMOEBA_PAPER.items():
        naive = col.startswith("Naive")
        micro, remat = (1, False) if naive else (batch, True)
        if tiny:
            L, D = 3, max(8, D // 32 // 8 * 8)
        recs = layer_records("amoebanet_d", num_layers=L, num_filters=D, image_size=image)
        plan = best_plan(recs, k, memory, batch, micro, remat)
        step = 8 if tiny else 16
        best = max_amoebanet_filters(L, k, memory, batch, micro, remat, step=step, image_size=image,
                                     upper=64 if tiny else 2048)
        best16 = max_amoebanet_filters(L, k, memory, batch, micro, remat, step=step, image_size=image,
                                       upper=64 if tiny else 2048, activation_scale=0.5)
        quarter = max_amoebanet_filters(L, k, memory, batch, micro if naive else batch // 4, remat, step=step,
                                        image_size=image, upper=64 if tiny else 2048)
        best_params = sum(r.params for r in layer_records(
            "amoebanet_d", num_layers=L, num_filters=best, image_size=image)) if best else 0
        acts = [p.activation_bytes for p in plan.partitions]
        for key, value in zip(rows, (
                f"({L}, {D})", p_params, f"{plan.params:,} ({fmt_count(plan.params)})", p_mem,
                fmt_bytes(sum(p.parameter_bytes for p in plan.partitions)), p_act,
                f"{fmt_bytes(sum(acts))} ({fmt_bytes(max(acts))})",
                f"{'yes' if plan.fits else 'no'} ({fmt_bytes(plan.peak_bytes)} peak)",
                f"({L}, {best})", fmt_count(best_params), f"({L}, {best16})",
                "-" if naive else f"({L}, {quarter})")):
            rows[key].append(value)
    return header, [[k, *v] for k, v in rows.items()]


def transformer_table(seq: int, batch: int, memory: float, tiny: bool) -> tuple[list[str], list[list[str]]]:
    """Rows of the Transformer-L half."""
    header = ["16 GiB accelerators", *TRANSFORMER_PAPER]
    rows: dict[str, list[str]] = {k: [] for k in (
        "paper layers", "paper # params", "ours # params (exact count)", "paper param memory",
        "ours param memory (12 B/param, GiB)", "paper peak activation", "ours peak activation, sum (max/stage)",
        "ours: paper config fits?", "ours largest (fp32 act.) layers", "  its # params",
        "ours largest (bf16 act.) layers", "ours largest (fp32, M = N/4) layers")}
    for col, (k, layers, p_params, p_mem, p_act) in TRANSFORMER_PAPER.items():
        naive = col.startswith("Naive")
        micro, remat = (1, False) if naive else (batch, True)
        if tiny:
            k, layers = min(k, 4), min(layers, 8)
        recs = layer_records("transformer_l", num_layers=layers, seq_len=seq)
        plan = best_plan(recs, k, memory, batch, micro, remat)
        upper = 64 if tiny else 4096
        best = max_transformer_layers(k, memory, batch, micro, remat, seq_len=seq, upper=upper)
        best16 = max_transformer_layers(k, memory, batch, micro, remat, seq_len=seq, upper=upper,
                                        activation_scale=0.5)
        quarter = max_transformer_layers(k, memory, batch, micro if naive else batch // 4, remat, seq_len=seq,
                                         upper=upper)
        best_params = sum(r.params for r in layer_records("transformer_l", num_layers=best, seq_len=seq))
        acts = [p.activation_bytes for p in plan.partitions]
        for key, value in zip(rows, (
                layers, p_params, f"{plan.params:,} ({fmt_count(plan.params)})", p_mem,
                fmt_bytes(sum(p.parameter_bytes for p in plan.partitions)), p_act,
                f"{fmt_bytes(sum(acts))} ({fmt_bytes(max(acts))})",
                f"{'yes' if plan.fits else 'no'} ({fmt_bytes(plan.peak_bytes)} peak)",
                best, fmt_count(best_params) if best else "-", best16, "-" if naive else quarter)):
            rows[key].append(value)
    return header, [[k, *v] for k, v in rows.items()]


def microbatch_sensitivity(image: int, batch: int, tiny: bool) -> tuple[list[str], list[list[str]]]:
    """Peak activation (sum over stages) of the paper's Pipeline-k AmoebaNet configs against M."""
    ms = [1, 8, 32, batch] if not tiny else [1, batch]
    header = ["config", *(f"M={m}" for m in ms), "paper"]
    rows = []
    for col, (k, L, D, _, _, p_act) in list(AMOEBA_PAPER.items())[1:]:
        if tiny:
            L, D = 3, max(8, D // 32 // 8 * 8)
        recs = layer_records("amoebanet_d", num_layers=L, num_filters=D, image_size=image)
        acts = [sum(p.activation_bytes for p in best_plan(recs, k, 8 * GiB, batch, m, True).partitions)
                for m in ms]
        rows.append([f"{col} ({L}, {D})", *(fmt_bytes(a) for a in acts), p_act])
    return header, rows


NOTES = Path(__file__).with_name("table1_notes.md")


def main() -> None:
    """Regenerate ``table1_capacity.md`` (+ ``.json``) under ``--out``."""
    args = parser(__doc__.split("\n")[0]).parse_args()
    image, seq = (32, 64) if args.tiny else (224, 1024)
    a_batch, t_batch = (8, 4) if args.tiny else (128, 32)
    a_head, a_rows = amoebanet_table(image, a_batch, 8 * GiB, args.tiny)
    t_head, t_rows = transformer_table(seq, t_batch, 16 * GiB, args.tiny)
    m_head, m_rows = microbatch_sensitivity(image, a_batch, args.tiny)
    md = [
        "# Table 1 — the largest model that fits (planned on the meta device)", "", provenance(), "",
        f"{'TINY smoke run (toy sizes, not the paper configs). ' if args.tiny else ''}"
        "Paper columns copied from the paper as printed; ours computed by `gpipe_lab.planner.capacity` "
        "from activation shapes measured on the meta device (saved-tensor hooks), float32, "
        "PyTorch eager. Memory in GiB (2^30 bytes); accelerators modelled as exactly 8 / 16 GiB.", "",
        f"## AmoebaNet-D, {image}x{image}, mini-batch {a_batch}, RMSProp (12 B/param)", "",
        f"Naive-1: one device, no re-materialization, whole batch. Pipeline-k: k partitions, "
        f"re-materialization, M = {a_batch} micro-batches (one image each, as torchgpipe's memory "
        "benchmark); balance chosen to minimise the largest partition.", "",
        md_table(a_head, a_rows), "",
        f"## Transformer-L (d 2048, FFN 8192, 32 heads, vocab 32k), seq {seq}, batch {t_batch}", "",
        f"Pipeline-k: M = {t_batch} micro-batches (one sequence each). The paper's Naive-1 memory "
        "cells look swapped (282.2M x 12 B = 3.15 GiB is the parameter memory).", "",
        md_table(t_head, t_rows), "",
        "## Peak activation of the paper's Pipeline-k AmoebaNet configs against M (sum over stages)", "",
        md_table(m_head, m_rows), "",
        NOTES.read_text() if NOTES.exists() else ""]
    path = write(args.out, "table1_capacity.md", "\n".join(md),
                 {"amoebanet": [a_head, *a_rows], "transformer": [t_head, *t_rows],
                  "microbatches": [m_head, *m_rows]})
    log_wandb(args.wandb, args.out, "table1_capacity",
              {"amoebanet": (a_head, a_rows), "transformer": (t_head, t_rows), "microbatches": (m_head, m_rows)})
    print(path)


if __name__ == "__main__":
    main()

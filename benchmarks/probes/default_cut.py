"""Probe: which per-layer cost makes the best automatic K=2 cut (the library's default ``cost``).

For the quick benchmark's three workloads (the MLP at the yardstick's batch, ``transformer_tiny``,
``amoebanet_d_tiny``) times, alternately in the same rounds, plain gradient accumulation over M=4
micro-batches (one thread, ``bench_yardstick.plain_step``) and ``GPipe.train_step`` at K=2, M=4,
``checkpoint="never"``, one intra-op thread per stage, cut by each cost kind of
``gpipe_lab.pipeline.measuring.costs.COST_KINDS`` (the measured kinds on one micro-batch, ``time``
with one intra-op thread). Each gain is the median of the per-round ratios plain / K=2
(``paired_ratio``); kinds that make the same cut share one contender. ``time`` is measured ``--time-cuts`` times more to show how often its cut moves
between measurements (a distributed pipeline takes rank 0's, ``resolve.agreed_balance``).

    python -m benchmarks.probes.default_cut [--rounds 9] [--out results/default_cut]

Writes ``<out>.md`` and ``<out>.json`` (with the machine, commit and load average) when ``--out`` is given.
"""

from __future__ import annotations

if not __package__:  # started as a file: rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.bench_ceiling import split_batch
from benchmarks.bench_common import SIZES, make_workload, prepare_process
from benchmarks.bench_yardstick import plain_step
from gpipe_lab.bench import md_table
from gpipe_lab.bench.machine import load_average, machine_info, provenance, provenance_meta
from gpipe_lab.pipeline import GPipe, balance_by_cost, layer_costs
from gpipe_lab.pipeline.measuring.call_timing import paired_ratio, time_rounds
from gpipe_lab.pipeline.measuring.costs import COST_KINDS

CHUNKS = 4
WORKLOADS = ("mlp", "transformer", "amoebanet")


def cut(module: torch.nn.Sequential, sample: object, kind: str) -> list[int]:
    """The K=2 balance ``kind`` gives ``module`` (measured kinds on ``sample``, one intra-op thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return balance_by_cost(layer_costs(module, kind, None if kind == "params" else sample), 2)
    finally:
        torch.set_num_threads(threads)


def measure(name: str, rounds: int, time_cuts: int) -> dict[str, object]:
    """Plain and each kind's K=2 step, alternated; the cuts and the gains plain / K=2."""
    sizes = dataclasses.replace(SIZES["quick"], mlp_batch=SIZES["quick"].yardstick_mlp_batch)
    plain = make_workload(name, sizes, partitions=1)
    sample = split_batch(plain.inputs, CHUNKS)[0]
    cuts = {kind: cut(plain.module, sample, kind) for kind in COST_KINDS}
    time_repeats = [cut(plain.module, sample, "time") for _ in range(time_cuts)]
    fns: dict[str, Callable[[], None]] = {"plain": plain_step(plain, CHUNKS, "cpu")}
    works = [plain]
    for balance in sorted({tuple(b) for b in cuts.values()}):  # kinds that cut alike share a contender
        work = make_workload(name, sizes, partitions=1)
        works.append(work)
        pipe = GPipe(work.module, balance=list(balance), chunks=CHUNKS, checkpoint="never", devices=["cpu"] * 2,
                     threads_per_stage=1, seed=0)
        fns[str(list(balance))] = lambda pipe=pipe, work=work: pipe.train_step(  # type: ignore[misc]
            work.inputs, work.targets, work.loss_fn)

    def zero() -> None:
        for work in works:
            work.module.zero_grad(set_to_none=True)

    times = time_rounds(fns, rounds, 1, zero)
    return {"workload": name, "batch": plain.batch, "layers": len(plain.module), "cuts": cuts,
            "time_cuts_repeated": time_repeats,
            "plain_s": times["plain"].median,
            "step_s": {kind: times[str(cuts[kind])].median for kind in COST_KINDS},
            "gain": {kind: paired_ratio(times["plain"], times[str(cuts[kind])]) for kind in COST_KINDS},
            "rounds_s": {k: list(t.times) for k, t in times.items()}}


def report(rows: list[dict], meta: dict[str, object]) -> str:
    """The markdown page: one row per workload, a gain (and cut) per kind."""
    header = ["workload", "batch", "plain s", *[f"{k}: gain (cut)" for k in COST_KINDS], "time's cut, repeated"]
    body = [[r["workload"], r["batch"], f"{r['plain_s']:.4f}",
             *[f"{r['gain'][k]:.2f}x {r['cuts'][k]}" for k in COST_KINDS],
             ", ".join(str(c) for c in r["time_cuts_repeated"])] for r in rows]
    geo = {k: statistics.geometric_mean([r["gain"][k] for r in rows]) for k in COST_KINDS}
    return "\n".join([
        "# The automatic K=2 cut by cost kind (plain gradient accumulation / K=2, M=4)", "",
        provenance(), "",
        f"Alternated rounds: {meta['rounds']} (each gain: the median of per-round ratios); "
        f"load average at the start {meta['load_start']}, at the end {meta['load_end']}. "
        "One CPU kind was available (the machine above), shared with other engineers' tests.", "",
        md_table(header, body), "",
        "Geometric mean of the gains over the workloads: "
        + ", ".join(f"{k} {g:.3f}x" for k, g in geo.items()) + ".", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--time-cuts", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.md and OUT.json")
    args = parser.parse_args(argv)
    prepare_process()
    torch.manual_seed(0)
    load_start = load_average()
    rows = []
    for name in args.workloads:
        rows.append(measure(name, args.rounds, args.time_cuts))
        print(f"[default_cut] {name}: " + ", ".join(f"{k} {g:.2f}x" for k, g in rows[-1]["gain"].items()), flush=True)
    meta = {**provenance_meta(), **machine_info("cpu"), "rounds": args.rounds, "M": CHUNKS, "K": 2,
            "load_start": load_start, "load_end": load_average()}
    page = report(rows, meta)
    print(page)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(page, encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The benchmarks: GPipe vs unpipelined training vs torch.distributed.pipelining (K=2).

Run from the repository root:

    python -m benchmarks.run --out results/full   # full grid (for the committed results: a quiet machine)
    python -m benchmarks.run --quick --out results   # the targets' configurations only
    python -m benchmarks.run --smoke --out /tmp/b   # tiny sizes, 1 repeat: a structure check
    python -m benchmarks.run --quick --compile      # also the compile row (minutes of Inductor)

Every mode first sets the engine at K=1 and K=2 (M=4) against plain PyTorch stepping the
same micro-batches (``bench_yardstick``: the overhead and the gain a user sees).
``--quick`` and the full grid also time ``gpipe-train``'s step against the raw engine's on
the Table-2 analogues (``bench_product_path``; ``--no-product`` skips it); ``--compile`` adds eager against
compiled stages (``bench_compile``) at the mode's sizes.

Writes ``benchmarks.md``, ``benchmarks.json`` and ``benchmarks/*.png`` under
``--out`` (default a fresh ``logs/benchmarks/<time>/``; ``--out results`` replaces the
committed results), and prints PASS / MISS per target.
"""

from __future__ import annotations

if not __package__:  # started as a file (``python benchmarks/run.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import datetime
import json
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.bench_app import run_compile_rows, run_product_rows
from benchmarks.bench_common import SIZES, Sizes, make_workload, prepare_process
from benchmarks.bench_gloo import GlooCase, run_gloo
from benchmarks.bench_local import run_workload
from benchmarks.bench_memory import run_memory
from benchmarks.bench_overhead import run_overhead
from benchmarks.bench_yardstick import replay_row, run_yardstick
from benchmarks.diagnose import diagnose
from benchmarks.report import write_report
from benchmarks.targets import evaluate, memory_m
from gpipe_lab.bench.machine import git_commit, load_average, machine_info
from gpipe_lab.bench.script_launch import fresh_out

ROOT = Path(__file__).resolve().parent.parent
#: --quick's product-path rows: model.num_layers at the configs' mini-batches (configs: 24 and 18)
QUICK_PRODUCT_LAYERS = {"transformer": 4, "amoebanet": 6}


def gloo_cases(sizes: Sizes) -> list[GlooCase]:
    """Ours (distributed transport) and torch.distributed.pipelining, MLP; ours also on the others."""
    cases: list[GlooCase] = []
    for m in sizes.torch_microbatches if "mlp" in sizes.models else ():
        for schedule in ("gpipe", "1f1b"):
            cases += [GlooCase("mlp", "torch", schedule, m), GlooCase("mlp", "ours", schedule, m)]
        cases += [GlooCase("mlp", "ours", schedule, m) for schedule in sizes.beyond_torch]
    if sizes.name == "full" and "mlp" in sizes.models:
        cases += [GlooCase("mlp", "ours", "gpipe", m, c) for m in sizes.microbatches for c in sizes.checkpoints
                  if not (c == "never" and m in sizes.torch_microbatches)]
    for name in [n for n in sizes.models if n != "mlp" and sizes.name != "quick"]:
        cases += [GlooCase(name, "ours", "gpipe", m) for m in sizes.model_microbatches]
    return cases


@contextmanager
def timed_section(results: dict, name: str) -> Iterator[None]:
    """Add the enclosed block's wall seconds to ``results["meta"]["sections_s"][name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        sections = results["meta"].setdefault("sections_s", {})
        sections[name] = sections.get(name, 0.0) + time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="only the targets' configurations")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat (tests)")
    parser.add_argument("--out", type=Path, default=fresh_out(ROOT / "logs", "benchmarks"),
                        help="output folder (default: a fresh logs/benchmarks/<time>/; --out results replaces "
                             "the committed results)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="stage devices")
    parser.add_argument("--no-distributed", action="store_true", help="skip the gloo runs")
    parser.add_argument("--models", default=None, help="comma-separated subset of mlp,transformer,amoebanet")
    parser.add_argument("--no-product", action="store_true", help="skip gpipe-train vs the raw engine")
    parser.add_argument("--compile", action="store_true", help="also eager vs compiled stages (slow)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="re-evaluate targets and re-render the report of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text(encoding="utf-8"))
        return finish(results, args.out)
    sizes = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.models:
        sizes = Sizes(**{**sizes.__dict__, "models": tuple(args.models.split(","))})
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    start = time.perf_counter()
    retained = prepare_process()
    results: dict = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(),
                              "command": "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None
                                                                                   else argv),
                              "mode": sizes.name, "machine": machine_info(args.device),
                              "load_before": load_average(),
                              "allocator": "glibc, freed memory retained (retain_freed_memory), for every "
                                           "contender" if retained else "system default"},
                     "local": {}, "memory": {}, "gloo": []}
    for name in sizes.models:
        print(f"[local] {name} ...", flush=True)
        work = make_workload(name, sizes).to(torch.device(args.device))
        ms = sizes.microbatches if name == "mlp" else sizes.model_microbatches
        cks = sizes.checkpoints if name == "mlp" else sizes.model_checkpoints
        with timed_section(results, "local"):
            results["local"][name] = run_workload(work, sizes, args.device, ms, cks,
                                                  sizes.torch_microbatches if name == "mlp" else (),
                                                  sizes.recompute_microbatches if name == "mlp" else ())
        mem_ms = [m for m in (4, 8, 16, 32) if m in ms] if sizes.name == "full" else [max(m for m in ms if m <= 8)]
        print(f"[memory] {name} M={mem_ms} ...", flush=True)
        with timed_section(results, "memory"):
            results["memory"][name] = run_memory(work, mem_ms, args.device, sizes.memory_checkpoints)
    print("[yardstick] plain gradient accumulation vs the engine at K=1 and K=2 ...", flush=True)
    # smoke checks the wiring on the MLP alone: the models' steps would double the smoke run
    with timed_section(results, "yardstick"):
        results["yardstick"] = run_yardstick(sizes, args.device, ["mlp"] if sizes.name == "smoke" else None)
    if sizes.name != "smoke":
        print("[replay] transformer with dropout: random replay's cost ...", flush=True)
        with timed_section(results, "replay"):
            results["replay"] = replay_row(sizes, args.device)
    print("[overhead] tiny layers ...", flush=True)
    with timed_section(results, "overhead"):
        results["overhead"] = run_overhead(sizes, args.device)
    if args.device == "cpu" and not args.no_distributed and sizes.distributed:
        print("[gloo] 2 processes ...", flush=True)
        with timed_section(results, "gloo"):
            results["gloo"] = run_gloo(gloo_cases(sizes), sizes.name, timeout=3600 if sizes.name == "full" else 900)
    if sizes.name != "smoke" and not args.no_product and args.device == "cpu":
        # the Table-2 analogues at their configs' mini-batches in every mode: Lightning's fixed per-step
        # cost would dominate the --quick sizes' short steps; --quick keeps a sixth / a third of the layers
        # (steps of a second or less, where a fixed cost shows more, not less) and fewer rounds
        quick = sizes.name == "quick"
        with timed_section(results, "product"):
            results["product"] = run_product_rows(quick=False, repeats=3 if quick else 8, warmup=1 if quick else None,
                                                  layers=QUICK_PRODUCT_LAYERS if quick else None)
    if args.compile:
        with timed_section(results, "compile"):
            results["compile"] = run_compile_rows(sizes.name != "full", (4,) if sizes.name != "full" else (4, 32),
                                                  repeats=5)
    results["meta"]["load_after"] = load_average()
    results["meta"]["duration_s"] = time.perf_counter() - start
    return finish(results, args.out)


def finish(results: dict, out: Path) -> int:
    """Evaluate the targets, write the report and print PASS / MISS lines."""
    results["targets"] = evaluate(results)
    results["notes"] = diagnose(results)
    write_report(results, out, memory_m(results))
    width = max(len(str(t["name"])) for t in results["targets"])
    for t in results["targets"]:
        print(f"{t['status']:4}  {str(t['name']):{width}}  {t['value']} {t['unit']}  (goal {t['goal']})")
    print(f"load average before {results['meta']['load_before']} after {results['meta']['load_after']}; "
          f"{results['meta']['duration_s']:.0f} s; wrote {out / 'benchmarks.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

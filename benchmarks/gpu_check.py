"""The prepared GPU check: every section capped, PASS/FAIL each, results in gpu_check.json and .md.

    python benchmarks/gpu_check.py --out results/           # on a machine with one GPU (<= 8 min)
    python benchmarks/gpu_check.py --out /tmp/x --two-gpus  # adds the two-GPU section
    python benchmarks/gpu_check.py --out /tmp/x --dry-run   # wires every section on the CPU

Sections: correctness, host_syncs, speed, memory (gpu_check_engine), lightning,
nccl_startup, two_gpus (gpu_check_system). A dry run uses tiny sizes on the CPU
and touches no CUDA: its figures are CPU figures and say so. A section that runs
past its cap is stopped (SIGALRM) and FAILs; the others still run.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # started as a file (``python benchmarks/gpu_check.py``): rerun as the module
    from gpipe_lab.bench.launch import rerun_as_module

    rerun_as_module(__file__)

import torch

from benchmarks.gpu_check_engine import Context, correctness, host_syncs, memory, speed
from benchmarks.gpu_check_system import lightning_run, nccl_startup, two_gpus

# name, function, cap in seconds (the sum stays under 8 minutes)
SECTIONS: list[tuple[str, Callable[[Context], dict[str, Any]], int]] = [
    ("correctness", correctness, 120), ("host_syncs", host_syncs, 30), ("speed", speed, 120),
    ("memory", memory, 60), ("lightning", lightning_run, 90), ("nccl_startup", nccl_startup, 30),
]
TWO_GPUS = ("two_gpus", two_gpus, 90)


class SectionTimeout(Exception):
    """A section ran past its cap."""


def _alarm(signum: int, frame: Any) -> None:
    raise SectionTimeout


def run_section(name: str, fn: Callable[[Context], dict[str, Any]], cap: int, ctx: Context) -> dict[str, Any]:
    """One section's result: its figures plus ``status`` (PASS/FAIL/SKIP) and ``seconds``."""
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(cap)
    try:
        result = fn(ctx)
    except SectionTimeout:
        result = {"status": "FAIL", "error": f"over its cap of {cap} s"}
    except Exception as exc:  # noqa: BLE001 - a failing section is reported, the others still run
        result = {"status": "FAIL", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=6)}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(f"[{result['status']}] {name} ({result['seconds']} s)"
          + (f": {result['error']}" if "error" in result else ""), flush=True)
    return result


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the environment, then one heading per section."""
    lines = ["# GPU check", "", f"- device: {report['device']}", f"- torch: {report['torch']}",
             f"- dry run: {report['dry_run']} (a dry run's figures are CPU figures, not GPU ones)", ""]
    for name, result in report["sections"].items():
        lines += [f"## {name}: {result['status']}", ""]
        for key, value in result.items():
            if key not in ("status", "traceback"):
                lines.append(f"- {key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the sections; exit status 0 when every one passed (or was skipped)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, no CUDA")
    p.add_argument("--two-gpus", action="store_true", help="add the two-GPU section")
    p.add_argument("--only", nargs="*", default=None, help="run only these sections")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: use --dry-run")
    ctx = Context(device=torch.device("cpu") if args.dry_run else torch.device("cuda", 0), dry=args.dry_run)
    sections = SECTIONS + ([TWO_GPUS] if args.two_gpus else [])
    if args.only:
        unknown = sorted(set(args.only) - {s[0] for s in sections})
        if unknown:
            p.error(f"unknown section(s) {unknown}; known: {[s[0] for s in sections]}")
        sections = [s for s in sections if s[0] in args.only]
    report = {"device": torch.cuda.get_device_name(0) if not args.dry_run else "cpu (dry run)",
              "torch": torch.__version__, "dry_run": args.dry_run,
              "sections": {name: run_section(name, fn, cap, ctx) for name, fn, cap in sections}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "gpu_check.md").write_text(markdown(report))
    failed = [n for n, r in report["sections"].items() if r["status"] == "FAIL"]
    print("FAILED: " + ", ".join(failed) if failed else "all sections passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The prepared GPU check: every section in its own process, PASS/FAIL each, reports after each one.

    python benchmarks/gpu_check.py --out results/           # on a machine with one GPU (<= 8 min)
    python benchmarks/gpu_check.py --out /tmp/x --two-gpus  # adds the two-GPU section
    python benchmarks/gpu_check.py --out /tmp/x --dry-run   # wires every section on the CPU

Sections (``SECTIONS``): correctness, host_syncs (gpu_check_engine); speed, memory
(gpu_check_speed); lightning, amp_fp16, nccl_startup, two_gpus (gpu_check_system);
backward_probe, race, launch_bound (gpu_check_probes); copy_overlap, leak
(gpu_check_device); distributed_links (gpu_check_links: clipping; with two GPUs,
receive streams, link warm-up, sends freed, reserved memory).

Each section runs in a child process forked from a server that imported the
sections once and never touched CUDA; the child leads its own process group.
A section that runs past its cap, hangs, or dies is killed with its whole
group (SIGKILL) and FAILs; the others still run. gpu_check.json and
gpu_check.md are rewritten after every section, so a hang loses one section,
not the report; within a section each case is appended to gpu_check_progress.jsonl
as it starts and finishes, and a killed section's entry names the case it hung in.
The run ends by printing where the report is and the command that commits it. A dry run uses tiny sizes on the CPU and touches no CUDA: its
figures are CPU figures and say so.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import multiprocessing
import os
import platform
import resource
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if not __package__:  # started as a file (``python benchmarks/gpu_check.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import torch

from benchmarks.gpu_check_engine import PROGRESS, Context, section_progress
from gpipe_lab.bench.machine import load_average, machine_info
from gpipe_lab.bench.provenance import source_commit

# name, "module:function", cap in seconds; on one GPU the caps sum to 460 s (8 minutes less start-up)
SECTIONS: list[tuple[str, str, int]] = [
    ("correctness", "benchmarks.gpu_check_engine:correctness", 65),
    ("host_syncs", "benchmarks.gpu_check_engine:host_syncs", 15),
    ("speed", "benchmarks.gpu_check_speed:speed", 60),
    ("memory", "benchmarks.gpu_check_speed:memory", 25),
    ("lightning", "benchmarks.gpu_check_system:lightning_run", 30),
    ("amp_fp16", "benchmarks.gpu_check_system:amp_fp16", 30),
    ("nccl_startup", "benchmarks.gpu_check_system:nccl_startup", 20),
    ("backward_probe", "benchmarks.gpu_check_probes:backward_probe", 65),
    ("race", "benchmarks.gpu_check_probes:race", 25),
    ("launch_bound", "benchmarks.gpu_check_probes:launch_bound", 30),
    ("copy_overlap", "benchmarks.gpu_check_device:copy_overlap", 20),
    ("leak", "benchmarks.gpu_check_device:leak", 15),
    # above the links run's own launch timeout (gpu_check_links.LAUNCH_TIMEOUT), so that one reports
    ("distributed_links", "benchmarks.gpu_check_links:distributed_links", 60),
]
#: caps of a dry run where it costs more than on a GPU machine (two spawned ranks on 2 cores)
DRY_CAPS = {"distributed_links": 90}
#: seconds the section server may take to import the sections (torch, Lightning)
STARTUP_CAP = 120
TWO_GPUS = ("two_gpus", "benchmarks.gpu_check_system:two_gpus", 90)
PRELOAD = ["benchmarks.gpu_check_engine", "benchmarks.gpu_check_speed", "benchmarks.gpu_check_system",
           "benchmarks.gpu_check_probes", "benchmarks.gpu_check_device", "benchmarks.gpu_check_links"]


def _section_main(spec: str, ctx: Context, conn: Any) -> None:
    """In the child: lead a process group, run the section, send its result, exit at once."""
    os.setsid()  # the parent kills the whole group: torchrun and its ranks too
    try:
        module, name = spec.split(":")
        result = getattr(importlib.import_module(module), name)(ctx)
        if ctx.device.type == "cuda":
            result["device_name"] = torch.cuda.get_device_name(ctx.device)
    except BaseException as exc:  # noqa: BLE001 - a failing section is reported, the others still run
        result = {"status": "FAIL", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=6)}
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result["cpu_seconds"] = round(sum(u.ru_utime + u.ru_stime for u in used), 2)
    conn.send(result)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a thread left hanging (the backward probe's) must not keep the process alive


def _kill_group(child: Any) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if child.is_alive():
            child.kill()
    child.join(10)


def run_section(name: str, spec: str, cap: int, ctx: Context, processes: Any) -> dict[str, Any]:
    """One section's result: its figures plus ``status`` (PASS/FAIL/SKIP) and ``seconds``."""
    start = time.perf_counter()
    receive, send = processes.Pipe(duplex=False)
    child = processes.Process(target=_section_main, args=(spec, ctx, send), name=f"gpu_check-{name}")
    child.start()
    send.close()
    try:
        if receive.poll(cap):
            result = receive.recv()
        else:
            result = {"status": "FAIL", "error": f"over its cap of {cap} s: killed"}
    except EOFError:
        child.join(5)
        died = f"its process died without a result (exit code {child.exitcode})"
        result = {"status": "FAIL", "error": died}
    finally:
        receive.close()
        _kill_group(child)
    if "error" in result and ctx.out is not None:  # what the killed or failed section got through
        result.update(section_progress(ctx.out, name))
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(f"[{result['status']}] {name} ({result['seconds']} s)"
          + (f": {result['error']}" if "error" in result else ""), flush=True)
    return result


def _processes() -> Any:
    """Children forked from a fresh server that imported the sections (never CUDA)."""
    processes = multiprocessing.get_context("forkserver")
    processes.set_forkserver_preload(PRELOAD)
    ready = processes.Process(target=_ready, name="gpu_check-ready")
    ready.start()  # the first fork waits for the server's imports: not charged to the first section's cap
    ready.join(STARTUP_CAP)
    if ready.exitcode is None:
        _kill_group(ready)
        raise RuntimeError(f"the section server did not start within {STARTUP_CAP} s")
    return processes


def _ready() -> None:
    """A child that does nothing: forking it waits for the server's imports."""


def write_reports(report: dict[str, Any], out: Path) -> None:
    """gpu_check.json and gpu_check.md as they stand (called after every section)."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the environment, then one heading per section."""
    meta = report["meta"]
    lines = ["# GPU check", "", f"- date: {meta['date']}, commit `{meta['commit']}`",
             f"- command: `{meta['command']}`", f"- device: {meta['device']}",
             f"- host: {meta['cpu']}, {meta['cores']} CPU cores, load average {meta['load_average']} at the start, "
             f"{meta.get('load_average_after', 'n/a (still running)')} at the end",
             f"- torch: {meta['torch']}, Python {meta['python']}, lightning {meta['lightning']}",
             f"- dry run: {report['dry_run']} (a dry run's figures are CPU figures, not GPU ones)",
             f"- start-up (section server) seconds: {report.get('startup_seconds')}", ""]
    for name, result in report["sections"].items():
        lines += [f"## {name}: {result['status']}", ""]
        for key, value in result.items():
            if key not in ("status", "traceback"):
                lines.append(f"- {key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
        lines.append("")
    return "\n".join(lines)


def _version(package: str) -> str:
    """An installed distribution's version, ``absent`` when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def main(argv: list[str] | None = None) -> int:
    """Run the sections; exit status 0 when every one passed (or was skipped)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, no CUDA")
    p.add_argument("--two-gpus", action="store_true", help="add the two-GPU section")
    p.add_argument("--only", nargs="*", default=None, help="run only these sections")
    p.add_argument("--commit", default=None,
                   help="the commit to record when this tree is a copy without git (default: read from git)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: use --dry-run")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / PROGRESS).unlink(missing_ok=True)  # this run's cases only
    ctx = Context(device=torch.device("cpu") if args.dry_run else torch.device("cuda", 0), dry=args.dry_run,
                  out=args.out)
    sections = SECTIONS + ([TWO_GPUS] if args.two_gpus else [])
    if args.only:
        unknown = sorted(set(args.only) - {s[0] for s in sections})
        if unknown:
            p.error(f"unknown section(s) {unknown}; known: {[s[0] for s in sections]}")
        sections = [s for s in sections if s[0] in args.only]
    # the device name is asked in a child: this process forks none, but keeps off CUDA all the same
    host = machine_info("cpu")  # the host's CPU and load; cpu: this process never touches CUDA
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": args.commit or source_commit(),
            "command": "python -m benchmarks.gpu_check " + shlex.join(sys.argv[1:] if argv is None else argv),
            "device": "cpu (dry run)" if args.dry_run else "cuda:0", "cpu": host["cpu"], "cores": host["cores"],
            "torch": torch.__version__, "python": platform.python_version(), "lightning": _version("lightning"),
            "load_average": host["load_average"]}
    report: dict[str, Any] = {"meta": meta, "dry_run": args.dry_run, "sections": {}}
    start = time.perf_counter()
    processes = _processes()
    report["startup_seconds"] = round(time.perf_counter() - start, 2)
    for name, spec, cap in sections:
        cap = DRY_CAPS.get(name, cap) if args.dry_run else cap
        result = run_section(name, spec, cap, ctx, processes)
        meta["device"] = result.pop("device_name", meta["device"])
        report["sections"][name] = result
        write_reports(report, args.out)
    meta["load_average_after"] = load_average()
    write_reports(report, args.out)
    failed = [n for n, r in report["sections"].items() if r["status"] == "FAIL"]
    print("FAILED: " + ", ".join(failed) if failed else "all sections passed")
    print(after_the_run(report, args.out), flush=True)
    return 1 if failed else 0


def after_the_run(report: dict[str, Any], out: Path) -> str:
    """Where the report is, and the command that commits it (with its ``meta``) from the repository."""
    files = [out / "gpu_check.md", out / "gpu_check.json"]
    meta = report["meta"]
    what = "dry run (CPU figures: do not commit as GPU results)" if report["dry_run"] else meta["device"]
    message = f"results: gpu_check on {what}, commit {meta['commit']}"
    return (f"report: {files[0]} and {files[1]} (cases as they finished: {out / 'gpu_check_progress.jsonl'})\n"
            f"commit it with: git add {shlex.join(str(f) for f in files)} && git commit -m {shlex.quote(message)}")


if __name__ == "__main__":
    raise SystemExit(main())

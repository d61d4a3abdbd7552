"""Regenerate the files of ``results/`` by their commands, one after the other, at one clean commit.

    python -m experiments.regenerate --list              # the jobs, in order, with their commands
    python -m experiments.regenerate                     # every job (about 4.5 h on two cores)
    python -m experiments.regenerate --only table1_capacity transfer
    python -m experiments.regenerate --resume            # skip jobs already done at this commit

"Commit" here is the source commit (``gpipe_lab.bench.provenance.commit_of``: the last commit that changed
anything but ``results/``, Markdown and the tests), so a regeneration may commit its files as it goes, stop, and
go on later with ``--resume``: every file still names the one code that made it.

Each job runs its commands (those ``results/README.md`` names) as processes of their own, from
the repository root, one at a time (the ``hydra.sweep.dir`` folders they name emptied first), so that no two measurements share the machine. After each
job ``results/regeneration.json`` records: the commit, the job's commands, when it started,
the machine (CPU model, cores, torch), its wall seconds, the load average before it and after it, and its exit status. A job that
fails is recorded and the run goes on with the next one (its exit status is 1 at the end).

Raises (as a one-line error and exit status 2): uncommitted changes to tracked files outside
``results/``, Markdown and the tests (every file would name a commit that did not make it), or a job name not in
``JOBS``.
"""

from __future__ import annotations

if not __package__:  # started as a file: rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpipe_lab.bench.machine import ROOT, git_commit, load_average, machine_info

PY = [sys.executable, "-m"]
#: every cell five times (``seed=0,1,2,3,4``, ``results_files.SEEDS_NEEDED``): the collector reports mean [min, max]
#: and the spread
SWEEP = ["gpipe_lab.app.train", "-m", "pipeline.partitions=1,2", "seed=0,1,2,3,4", "logger=csv"]
#: the unpipelined model on one thread, with and without re-materialization (experiments.microbatch_cost)
ONE_THREAD_K1 = ["gpipe_lab.app.train", "-m", "pipeline.partitions=1", "pipeline.threads_per_stage=1",
                 "pipeline.checkpoint=never,except_last", "seed=0", "logger=csv"]
MICROBATCH_COST = [("paper_table2_amoebanet", "logs/table2_mb_cost"), ("paper_table2_transformer", "logs/table2_mb_cost_tf")]
#: job name: its commands, in order (results/README.md lists them as regeneration.json records them)
JOBS: dict[str, list[list[str]]] = {
    "table1_capacity": [PY + ["experiments.table1_capacity", "--out", "results"]],
    "emulated_scaling": [PY + ["experiments.emulated_scaling", "--out", "results"]],
    "nmt_scaling": [PY + ["experiments.nmt_scaling", "--out", "results"]],
    "transfer": [PY + ["experiments.transfer", "--out", "results"]],
    "table2_throughput": [PY + ["experiments.table2_throughput", "--out", "results"]],
    "table3_throughput": [PY + ["experiments.table3_throughput", "--out", "results"]],
    "overheads": [PY + ["experiments.overheads", "--out", "results"]],
    "simulator_heldout": [PY + ["experiments.simulator_heldout", "--out", "results"]],
    "sweeps": [PY + SWEEP + ["experiment=paper_table2_amoebanet", "pipeline.chunks=1,4,32",
                             "hydra.sweep.dir=logs/table2_sweep"],
               PY + SWEEP + ["experiment=paper_table2_transformer", "pipeline.chunks=1,4,32",
                             "hydra.sweep.dir=logs/table2_sweep_tf"],
               PY + ["experiments.table2_throughput", "--from-multirun", "logs/table2_sweep", "logs/table2_sweep_tf",
                     "--out", "results/sweeps"],
               *(PY + ONE_THREAD_K1 + [f"experiment={e}", "pipeline.chunks=1,4,32", f"hydra.sweep.dir={d}"]
                 for e, d in MICROBATCH_COST),
               PY + ["experiments.microbatch_cost", "--from-multirun", *(d for _, d in MICROBATCH_COST),
                     "--out", "results/sweeps"]],
    "plan_check": [PY + ["experiments.plan_check", "--out", "results"]],
    "benchmarks": [PY + ["benchmarks.run", "--quick", "--out", "results"]],
    "schedules": [PY + ["benchmarks.bench_schedules", "--out", "results/schedules"]],
    "trainability": [PY + ["experiments.trainability_search", "--out", "results"],
                     PY + ["experiments.trainability", "--out", "results"]],
    # the longest and least central last (Inductor's code generation: minutes per stage on two cores), so that a
    # run stopped early and continued with --resume has the paper's tables first
    "sweeps_compiled": [PY + SWEEP + ["experiment=paper_table2_transformer", "pipeline.chunks=1,4",
                                      "pipeline.compile=true", "pipeline.timeout=3600",
                                      "hydra.sweep.dir=logs/table2_sweep_tf_compiled"],
                        PY + ["experiments.table2_throughput", "--from-multirun", "logs/table2_sweep_tf_compiled",
                              "--out", "results/sweeps/compiled"]],
    "benchmarks_full": [PY + ["benchmarks.run", "--out", "results/full", "--compile"]],
    # last: results/README.md, computed from the files above (seconds; rerun it alone after any of them)
    "results_readme": [PY + ["experiments.results_readme"]],
}


def shown(argv: list[str]) -> str:
    """A command as a user types it."""
    return " ".join(["python", *argv[1:]] if argv[0] == sys.executable else argv)


def run_job(name: str, commands: list[list[str]], root: Path = ROOT) -> dict[str, object]:
    """Run one job's commands in order (stopping at the first that fails); its record."""
    machine = machine_info("cpu")
    record: dict[str, object] = {"job": name, "commit": git_commit(), "commands": [shown(c) for c in commands],
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": machine["cpu"],
                                 "cores": machine["cores"], "torch": machine["torch"],
                                 "load_before": machine["load_average"]}
    began, status = time.monotonic(), 0
    for argv in commands:  # a sweep folder left from an earlier run would add its stale jobs to the tables
        for folder in (a.split("=", 1)[1] for a in argv if a.startswith("hydra.sweep.dir=")):
            shutil.rmtree(root / folder, ignore_errors=True)
    for argv in commands:
        print(f"[regenerate {name}] {shown(argv)}", flush=True)
        status = subprocess.run(argv, cwd=root, check=False).returncode
        if status != 0:
            break
    record.update({"seconds": round(time.monotonic() - began, 1), "load_after": load_average(), "exit_status": status})
    return record


def main(argv: list[str] | None = None, path: Path = ROOT / "results" / "regeneration.json") -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", metavar="JOB", help="these jobs (in JOBS' order)")
    p.add_argument("--resume", action="store_true", help="skip the jobs recorded as done at this commit")
    p.add_argument("--list", action="store_true", help="print the jobs and their commands")
    args = p.parse_args(argv)
    unknown = sorted(set(args.only or []) - set(JOBS))
    if unknown:
        print(f"regenerate: error: unknown job(s) {unknown}; allowed: {list(JOBS)}", file=sys.stderr)
        return 2
    names = [n for n in JOBS if not args.only or n in args.only]
    if args.list:
        for n in names:
            print(f"{n}: " + "; then ".join(shown(c) for c in JOBS[n]))
        return 0
    commit = git_commit()  # one git call for every record below; "+dirty": source files changed (``NOT_SOURCE``)
    if commit.endswith("+dirty"):
        print(f"regenerate: error: uncommitted changes to source files (anything but results/, *.md and the tests; commit {commit}); commit or "
              "stash them first, so that every file names the commit that made it", file=sys.stderr)
        return 2
    records = json.loads(path.read_text()) if path.exists() else []
    done = {r["job"] for r in records if r["commit"] == commit and r["exit_status"] == 0}
    failed = 0
    for n in names:
        if args.resume and n in done:
            print(f"[regenerate {n}] done at {commit}: skipped", flush=True)
            continue
        record = run_job(n, JOBS[n])
        records = [r for r in records if r["job"] != n] + [record]
        path.write_text(json.dumps(records, indent=2) + "\n")
        failed += record["exit_status"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The differential harness's full product, by design, as a resumable job outside pytest.

    python tests/engine/differential_full.py --run-all --shards 2   # the whole design, then --summary
    python tests/engine/differential_full.py --shard 0/2            # one shard (and --shard 1/2 beside it)
    python tests/engine/differential_full.py --summary              # count the logs, write summary.md
    python tests/engine/differential_full.py --clean                # drop judgements of another engine

The cases are the design's (``differential_design``): every FOUND combination, the full
product over the axes where defects lived, and a covering array of strength 3 over every
axis, in place of the Cartesian product's millions of cases; ``<log>/design.json`` holds
it (made again, about two minutes, when the axes or the harness change). Each shard takes
every n-th case of the design from the i-th, judges it as the test does
(``differential_run.judge``) and appends one JSON line per chunk of cases to
``<log>/shard-i-of-n.jsonl`` (``results/differential`` by default, small enough to commit):
the engine digest it judged, the commit, the seconds the chunk took, the load, the passed
cases as index ranges and each failed case with its recipe and problems. A judgement counts
only while the engine digest (``engine_digest``: the engine's and the harness's source, the
design's included, and torch's version) is the current one, so a change to the engine starts
the product again. A restarted shard skips what any log holds as passed for the current
digest (so shards of another n can take over the rest) and judges its failed cases again
(the latest line of a case counts). ``--summary`` counts every shard's log and writes
``<log>/summary.md``; it exits 1 while a case has failed and 2 while cases remain.
``--run-all`` drops other digests' lines (``--clean``; git history keeps them), starts the
shards as child processes, waits for them (``--timeout``; an interrupt or the timeout stops
them and what they logged stays), then writes the summary and exits with its code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torchvision

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the harness, and tests/ for helpers.zoo

import differential_distributed  # noqa: E402
from differential_cases import AXES, Case  # noqa: E402
from differential_design import Design, make_design  # noqa: E402
from differential_distributed import run_distributed  # noqa: E402
from differential_run import judge, run_engine  # noqa: E402

import gpipe_lab.pipeline  # noqa: E402
from gpipe_lab.bench.provenance import source_commit  # noqa: E402

# cases per log line: what an interrupted shard loses at most (local cases: a zoo CNN's case takes
# seconds on a busy machine), and a distributed chunk runs in one launch per K (each launch costs a
# few seconds of process start-up)
CHUNK, DISTRIBUTED_CHUNK = 25, 100
HARNESS = ("differential_cases.py", "differential_run.py", "differential_compare.py",
           "differential_distributed.py", "differential_design.py", "differential_found.py", "../helpers/zoo.py")
DEFAULT_LOG = HERE.parents[1] / "results" / "differential"
DESIGN = "design.json"


def engine_digest() -> str:
    """What a judgement depends on: every engine source file (its measuring of the automatic balances'
    costs included), the harness's (the zoo's models and the design included), torch's and
    torchvision's versions."""
    engine = Path(gpipe_lab.pipeline.__file__).parent
    files = sorted(engine.rglob("*.py")) + [HERE / name for name in HARNESS]
    h = hashlib.sha256(torch.__version__.encode() + torchvision.__version__.encode())
    for path in files:  # the path below its root: a file moved between the engine's folders counts
        name = path.relative_to(engine) if path.is_relative_to(engine) else Path(path.name)
        h.update(name.as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def design(log: Path) -> Design:
    """The design ``<log>/design.json`` holds if it is current, else a new one, saved there."""
    found = Design.load(log / DESIGN)
    if found is None:
        print("making the design (every valid case enumerated, then the covering array) ...", flush=True)
        found = make_design()
        log.mkdir(parents=True, exist_ok=True)
        found.save(log / DESIGN)
    return found


def the_cases(log: Path) -> list[Case]:
    """The design's cases, in the order the logs number them."""
    return design(log).cases()


def _log_path(log: Path, i: int, n: int) -> Path:
    return log / f"shard-{i}-of-{n}.jsonl"


def _ranges(indices: list[int], step: int) -> list[list[int]]:
    """Sorted indices as [first, last] runs of ``step``."""
    runs: list[list[int]] = []
    for k in indices:
        if runs and k == runs[-1][1] + step:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return runs


@dataclass
class Judged:
    """A shard log read for one engine digest: each case's latest verdict, and what else it holds."""

    ok: dict[int, bool] = field(default_factory=dict)
    failures: dict[int, dict] = field(default_factory=dict)
    seconds: float = 0.0
    commits: Counter = field(default_factory=Counter)
    # the wall-clock span of the chunks (first start, last end) and their loads, where the lines say
    span: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    # judgements of another engine digest, per digest: [judged, failed, seconds]
    stale: dict[str, list[float]] = field(default_factory=dict)


def read_log(path: Path, digest: str) -> Judged:
    out = Judged()
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        _, n = row["shard"]
        count = sum((b - a) // n + 1 for a, b in row["passed"]) + len(row["failed"])
        if row["engine"] != digest:
            earlier = out.stale.setdefault(row["engine"], [0, 0, 0.0])
            earlier[0] += count
            earlier[1] += len(row["failed"])
            earlier[2] += row["seconds"]
            continue
        out.seconds += row["seconds"]
        out.commits[row["commit"]] += count
        if "end" in row:
            out.span = [min(out.span[:1] + [row["end"] - row["seconds"]]), max(out.span[1:] + [row["end"]])]
            out.loads.append(row["load"])
        for a, b in row["passed"]:
            for k in range(a, b + 1, n):
                out.ok[k] = True
                out.failures.pop(k, None)
        for failure in row["failed"]:
            out.ok[failure["index"]] = False
            out.failures[failure["index"]] = failure
    return out


def read_logs(log: Path, digest: str) -> Judged:
    """Every shard log of ``log`` merged (shards of another n may hold the same cases):
    a case failed if its latest verdict in some log failed."""
    out = Judged()
    for path in sorted(log.glob("shard-*.jsonl")):
        one = read_log(path, digest)
        for k, ok in one.ok.items():
            out.ok[k] = out.ok.get(k, True) and ok
        out.failures.update(one.failures)
        out.seconds += one.seconds
        out.commits += one.commits
        if one.span:
            out.span = [min(out.span[:1] + one.span[:1]), max(out.span[1:] + one.span[1:])]
        out.loads += one.loads
        for other, (judged, failed, seconds) in one.stale.items():
            earlier = out.stale.setdefault(other, [0, 0, 0.0])
            earlier[0], earlier[1], earlier[2] = earlier[0] + judged, earlier[1] + failed, earlier[2] + seconds
    out.failures = {k: f for k, f in out.failures.items() if not out.ok[k]}
    return out


def clean(log: Path, digest: str) -> int:
    """Drop every log line of another engine digest (they no longer count; git history keeps them),
    and the logs left empty; the number of lines dropped."""
    dropped = 0
    for path in sorted(log.glob("shard-*.jsonl")):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line)["engine"] == digest]
        dropped += len(lines) - len(kept)
        if not kept:
            path.unlink()
        elif len(kept) < len(lines):
            path.write_text("\n".join(kept) + "\n")
    return dropped


def _run_distributed(cases: list[Case]) -> dict[Case, tuple | str]:
    """Each case's two runs, or the error of the launch that held it. After a case fails mid-step its
    launch's next pipe raises ``GroupUnusableError`` and the launch fails as a whole
    (``differential_distributed.worker``): its cases then run again one launch each, so only the
    failing case fails."""
    try:
        return dict(run_distributed(cases))
    except RuntimeError as exc:  # a rank died or hung
        if len(cases) == 1:
            return {cases[0]: str(exc).splitlines()[0]}
        print(f"a launch failed ({str(exc).splitlines()[0]}): its {len(cases)} cases again, one launch each",
              flush=True)
        return {case: got for one in cases for case, got in _run_distributed([one]).items()}


def _judge_chunk(chunk: list[tuple[int, Case]]) -> list[tuple[int, Case, list[str]]]:
    distributed = [c for _, c in chunk if c.transport == "distributed"]
    runs = _run_distributed(distributed) if distributed else {}
    out = []
    for index, case in chunk:
        if case.transport == "distributed":
            got = runs[case]
            problems = [got] if isinstance(got, str) else judge(case, *got)
        else:
            problems = judge(case, run_engine(case), None)
        out.append((index, case, problems))
    return out


def run_shard(log: Path, i: int, n: int, limit: int | None = None) -> int:
    """Judge shard ``i`` of ``n`` (at most ``limit`` cases this run); the number of its cases
    that failed (this run and before) under the current engine digest."""
    cases, digest, commit = the_cases(log), engine_digest(), source_commit()
    path = _log_path(log, i, n)
    log.mkdir(parents=True, exist_ok=True)
    done = {k for k, ok in read_logs(log, digest).ok.items() if ok}
    todo = [(k, cases[k]) for k in range(i, len(cases), n) if k not in done][:limit]
    print(f"shard {i}/{n} at engine {digest}: {len(done)} passed in all logs, {len(todo)} of this shard to go",
          flush=True)
    start, count = time.monotonic(), 0
    local = [t for t in todo if t[1].transport == "local"]
    distributed = [t for t in todo if t[1].transport == "distributed"]
    chunks = ([local[c:c + CHUNK] for c in range(0, len(local), CHUNK)]
              + [distributed[c:c + DISTRIBUTED_CHUNK] for c in range(0, len(distributed), DISTRIBUTED_CHUNK)])
    for chunk in chunks:
        t0 = time.monotonic()
        judged = _judge_chunk(chunk)
        failed = [{"index": k, "recipe": case.recipe(), "problems": p} for k, case, p in judged if p]
        row = {"engine": digest, "commit": commit, "shard": [i, n], "seconds": round(time.monotonic() - t0, 1),
               "end": round(time.time(), 1), "load": round(os.getloadavg()[0], 2),
               "passed": _ranges([k for k, _, p in judged if not p], n), "failed": failed}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for r in failed:
            print(f"FAILED GPIPE_DIFFERENTIAL_CASE='{r['recipe']}': {r['problems'][0]}", flush=True)
        count += len(judged)
        print(f"shard {i}/{n}: {count} of {len(todo)} judged, {count / (time.monotonic() - start):.2f} cases/s",
              flush=True)
    mine = read_log(path, digest).ok
    return sum(1 for k in range(i, len(cases), n) if mine.get(k) is False)


def describe(d: Design) -> list[str]:
    """The design in words: what it holds, what it stands for."""
    total = len(d.found) + len(d.defects) + len(d.covering)
    return [
        f"design {d.key}: {total} cases in place of the {d.valid:,} valid cases of the Cartesian product of "
        f"{len(AXES)} axes ({d.cartesian:,} combinations before the axes' constraints):",
        f"{len(d.found)} FOUND combinations (each that found a defect); {len(d.defects)} more for the full product "
        f"over {' x '.join(d.defect_axes)} (every value combination a valid case takes, the FOUND ones included); "
        f"{len(d.covering)} more to complete a covering array of strength {d.strength}: every {d.strength} values "
        f"of any {d.strength} axes that a valid case takes ({d.feasible:,} such tuples) appear together in a case, "
        f"checked by `differential_design.missing` when the design is made",
    ]


def summary(log: Path) -> int:
    """Print the counts over every shard's log (and write them to ``<log>/summary.md``):
    0 all passed, 1 a failure, 2 cases remain."""
    d, digest = design(log), engine_digest()
    total = len(d.found) + len(d.defects) + len(d.covering)
    merged = read_logs(log, digest)
    judged, failures = len(merged.ok), list(merged.failures.values())
    commits, seconds, stale = merged.commits, merged.seconds, merged.stale
    lines = describe(d)
    lines += [f"FAILED {f['recipe']}: {f['problems'][0]}" for f in failures]
    lines.append(f"{judged} of {total} cases judged at engine {digest}, {judged - len(failures)} passed, "
                 f"{len(failures)} failed, in {seconds / 3600:.2f} shard-hours; judged at commit: "
                 + (", ".join(f"{c} ({k})" for c, k in sorted(commits.items())) or "none"))
    if merged.span:
        lines.append(f"wall clock from the first chunk's start to the last one's end: "
                     f"{(merged.span[1] - merged.span[0]) / 60:.1f} min; load average (1 min) at the chunks' "
                     f"ends {min(merged.loads):.1f} to {max(merged.loads):.1f} on {os.cpu_count()} cores")
    for other, (n, failed, hours) in sorted(stale.items()):
        lines.append(f"not counted: {int(n)} judgements at engine {other} ({int(failed)} failed, "
                     f"{hours / 3600:.2f} shard-hours), an earlier engine or harness")
    print("\n".join(lines))
    if log.exists():
        (log / "summary.md").write_text(
            "# The differential harness's full product, by design\n\nGenerated by `python "
            "tests/engine/differential_full.py --summary` from `design.json` and the shard logs here "
            "(one line per chunk of cases).\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    return 1 if failures else (2 if judged < total else 0)


def _stop(procs: list[subprocess.Popen]) -> None:
    """End each shard still running and the processes it started (its own process group)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_all(log: Path, shards: int, timeout: float) -> int:
    """The whole design: drop other digests' lines, judge ``shards`` shards side by side as child
    processes for at most ``timeout`` seconds, then the summary's code (2 if stopped early)."""
    design(log)  # made once here, not by every shard
    digest = engine_digest()
    print(f"dropped {clean(log, digest)} log lines of other engines (git history keeps them)", flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--log", str(log)]
    procs = [subprocess.Popen([*cmd, "--shard", f"{i}/{shards}"], start_new_session=True) for i in range(shards)]
    previous = signal.signal(signal.SIGTERM, _interrupted)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"--timeout {timeout:g} s reached: stopping the shards (what they logged counts)", flush=True)
    except KeyboardInterrupt:
        print("interrupted: stopping the shards (what they logged counts)", flush=True)
    finally:
        _stop(procs)
        signal.signal(signal.SIGTERM, previous)
    return summary(log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=DEFAULT_LOG)
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th case from the i-th (0-based)")
    parser.add_argument("--limit", type=int, default=None, help="judge at most this many cases now")
    parser.add_argument("--summary", action="store_true", help="count the logs instead of running")
    parser.add_argument("--clean", action="store_true", help="drop the log lines of other engine digests")
    parser.add_argument("--run-all", action="store_true", help="clean, run --shards shards side by side, summary")
    parser.add_argument("--shards", type=int, default=2, help="with --run-all: how many shards at once")
    parser.add_argument("--timeout", type=float, default=3600.0, help="with --run-all: seconds before stopping")
    args = parser.parse_args(argv)
    if args.summary:
        return summary(args.log)
    if args.clean:
        print(f"dropped {clean(args.log, engine_digest())} log lines of other engines")
        return 0
    # one launch of K processes per K and chunk (the harness's default is sized for the test's few cases):
    # starting a launch costs seconds; the judgement does not depend on how cases are grouped
    differential_distributed.PER_LAUNCH = DISTRIBUTED_CHUNK
    if args.run_all:
        if args.shards < 1 or args.timeout <= 0:
            parser.error(f"--shards {args.shards} --timeout {args.timeout:g}: expected both above 0")
        return run_all(args.log, args.shards, args.timeout)
    try:
        i, n = (int(v) for v in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        parser.error(f"--shard {args.shard!r}: expected i/n with 0 <= i < n")
    return 1 if run_shard(args.log, i, n, args.limit) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The differential harness's full product, as a resumable job outside pytest.

    python tests/engine/differential_full.py --shard 0/2 --log differential-log
    python tests/engine/differential_full.py --summary --log differential-log

Each shard takes every n-th case of ``all_cases()`` from the i-th, judges it as the
test does (``differential_run.judge``) and appends one JSON line per case, with the
commit that judged it, to ``<log>/shard-i-of-n.jsonl``; a restarted shard skips what its
log holds, so an interrupted job loses at most the chunk in flight, and judges its failed
cases again (the latest line of a case counts). A failing case's line carries the recipe
that reruns it under pytest. ``--summary`` counts every shard's log; it exits 1
while a case has failed and 2 while cases remain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from differential_cases import Case, all_cases  # noqa: E402
from differential_distributed import run_distributed  # noqa: E402
from differential_run import judge, run_engine  # noqa: E402

from gpipe_lab.provenance import source_commit  # noqa: E402

CHUNK = 400  # cases between log flushes (distributed ones in one launch per K)


def _log_path(log: Path, i: int, n: int) -> Path:
    return log / f"shard-{i}-of-{n}.jsonl"


def _latest(path: Path) -> dict[int, dict]:
    """Each judged case's latest line (a re-judged case appends a new one)."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {row["index"]: row for row in rows}


def _done(path: Path) -> set[int]:
    """The cases that passed: a failed one is judged again by the next run (a launch that died with
    the machine, or a fix since), and its new line replaces the old."""
    return {index for index, row in _latest(path).items() if row["ok"]}


def _judge_chunk(chunk: list[tuple[int, Case]]) -> list[dict]:
    rows = []
    distributed = [c for _, c in chunk if c.transport == "distributed"]
    try:
        runs = run_distributed(distributed) if distributed else {}
        launch_error = None
    except RuntimeError as exc:  # a rank died: every distributed case of the chunk fails with it
        runs, launch_error = {}, str(exc).splitlines()[0]
    for index, case in chunk:
        if case.transport == "distributed":
            problems = [launch_error] if launch_error else judge(case, *runs[case])
        else:
            problems = judge(case, run_engine(case), None)
        rows.append({"index": index, "ok": not problems, "recipe": case.recipe(), "problems": problems,
                     "commit": source_commit()})
    return rows


def run_shard(log: Path, i: int, n: int) -> int:
    """Judge shard ``i`` of ``n``; the number of its cases that failed (this run and before)."""
    cases = all_cases()
    path = _log_path(log, i, n)
    log.mkdir(parents=True, exist_ok=True)
    done = _done(path)
    todo = [(k, cases[k]) for k in range(i, len(cases), n) if k not in done]
    print(f"shard {i}/{n}: {len(done)} judged before, {len(todo)} to go", flush=True)
    start = time.monotonic()
    for c in range(0, len(todo), CHUNK):
        rows = _judge_chunk(todo[c:c + CHUNK])
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for r in rows:
            if not r["ok"]:
                print(f"FAILED GPIPE_DIFFERENTIAL_CASE='{r['recipe']}': {r['problems'][0]}", flush=True)
        rate = (c + len(rows)) / (time.monotonic() - start)
        print(f"shard {i}/{n}: {len(done) + c + len(rows)} judged, {rate:.1f} cases/s", flush=True)
    return sum(1 for row in _latest(path).values() if not row["ok"])


def summary(log: Path) -> int:
    """Print the counts over every shard's log: 0 all passed, 1 a failure, 2 cases remain."""
    total = len(all_cases())
    judged = failed = 0
    commits: Counter[str] = Counter()
    for path in sorted(log.glob("shard-*.jsonl")):
        for row in _latest(path).values():
            judged += 1
            commits[row.get("commit", "unrecorded")] += 1
            if not row["ok"]:
                failed += 1
                print(f"FAILED {row['recipe']}: {row['problems'][0]}")
    print(f"{judged} of {total} combinations judged, {judged - failed} passed, {failed} failed; "
          f"judged at commit: {', '.join(f'{c} ({n})' for c, n in sorted(commits.items()))}")
    return 1 if failed else (2 if judged < total else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=Path("differential-log"))
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th case from the i-th (0-based)")
    parser.add_argument("--summary", action="store_true", help="count the logs instead of running")
    args = parser.parse_args(argv)
    if args.summary:
        return summary(args.log)
    try:
        i, n = (int(v) for v in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        parser.error(f"--shard {args.shard!r}: expected i/n with 0 <= i < n")
    return 1 if run_shard(args.log, i, n) else 0


if __name__ == "__main__":
    sys.exit(main())

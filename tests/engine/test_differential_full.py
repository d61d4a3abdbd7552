"""The full-product runner (``differential_full.py``): resumable, compact, judged per engine digest."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import differential_distributed
import differential_full as full
import pytest
from differential_cases import Case
from differential_design import Design, design_key, encode

from gpipe_lab.bench.provenance import source_commit

CASES = [Case.parse(r) for r in (
    "door=train_step,K=2,M=3,batch=10,checkpoint=except_last,schedule=gpipe,bn=plain,rand=dropout,"
    "autocast=none,inputs=tensor,frozen=False,dtype=float32,output=tensor,track_memory=True,transport=local",
    "door=backward,K=1,M=1,batch=12,checkpoint=never,schedule=gpipe,bn=none,rand=none,"
    "autocast=none,inputs=tensor,frozen=False,dtype=float32,output=dict,track_memory=True,transport=local",  # must refuse
    "door=nograd_train,K=3,M=4,batch=12,checkpoint=never,schedule=gpipe,bn=deferred,rand=functional,"
    "autocast=bf16,inputs=tuple,frozen=True,dtype=float32,output=tensor,track_memory=True,transport=local",
    # a zoo model's case: the new axes in the recipe, the log and the summary
    "door=train_step,K=2,M=3,batch=4,checkpoint=never,schedule=1f1b,bn=none,rand=none,autocast=none,"
    "inputs=tensor,frozen=False,dtype=float32,output=tensor,track_memory=True,transport=local,model=tagger,"
    "transition=freeze,grads=zero,cost=flops",
)]


def tiny_design(cases: list[Case] = CASES) -> Design:
    """A design of ``cases`` (all as FOUND ones), under the current key (a shard process loads it)."""
    return Design(design_key(), encode(cases).tolist(), [], [], valid=len(cases), cartesian=10 ** 9, feasible=7)


def _rows(log: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(log.glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_ranges_are_runs_of_the_shard_step() -> None:
    assert full._ranges([1, 3, 5, 9, 11], 2) == [[1, 5], [9, 11]]
    assert full._ranges([], 3) == []


def test_shards_judge_every_case_once_and_resume_judging_only_what_failed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(full, "design", lambda log: tiny_design())
    assert full.run_shard(tmp_path, 0, 2) == 0 and full.run_shard(tmp_path, 1, 2) == 0
    rows = _rows(tmp_path)
    assert sorted(tuple(r) for row in rows for r in row["passed"]) == [(0, 2), (1, 3)]
    assert {row["engine"] for row in rows} == {full.engine_digest()}
    assert {row["commit"] for row in rows} == {source_commit()}
    assert all(row["failed"] == [] and row["seconds"] >= 0 for row in rows)
    assert full.summary(tmp_path) == 0
    assert "4 of 4 cases judged" in (tmp_path / "summary.md").read_text()

    # a case recorded as failed (a launch that died, say) is judged again; passed ones are not
    path = tmp_path / "shard-0-of-2.jsonl"
    failed = {"engine": full.engine_digest(), "commit": "x", "shard": [0, 2], "seconds": 1.0, "passed": [],
              "failed": [{"index": 2, "recipe": CASES[2].recipe(), "problems": ["rank 0 exit -9: None"]}]}
    path.write_text(path.read_text() + json.dumps(failed) + "\n")
    assert full.summary(tmp_path) == 1
    assert full.run_shard(tmp_path, 0, 2) == 0
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["passed"] == [[2, 2]] and last["failed"] == []  # only the failed case ran again
    assert full.summary(tmp_path) == 0


def test_a_judgement_of_another_engine_does_not_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(full, "design", lambda log: tiny_design())
    old = {"engine": "000000000000", "commit": "old", "shard": [0, 1], "seconds": 1.0, "passed": [[0, 1]],
           "failed": [{"index": 2, "recipe": CASES[2].recipe(), "problems": ["differs"]}]}
    (tmp_path / "shard-0-of-1.jsonl").write_text(json.dumps(old) + "\n")
    assert full.summary(tmp_path) == 2
    out = capsys.readouterr().out
    assert f"0 of 4 cases judged at engine {full.engine_digest()}" in out
    assert "not counted: 3 judgements at engine 000000000000 (1 failed, 0.00 shard-hours)" in out
    assert "not counted: 3 judgements at engine 000000000000" in (tmp_path / "summary.md").read_text()
    assert full.run_shard(tmp_path, 0, 1, limit=1) == 0  # judges case 0 again, not from the old line
    assert _rows(tmp_path)[-1]["passed"] == [[0, 0]]


def test_summary_says_cases_remain_and_a_bad_shard_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(full, "design", lambda log: tiny_design())
    full.run_shard(tmp_path, 0, 3)
    assert full.summary(tmp_path) == 2
    assert f"2 of 4 cases judged at engine {full.engine_digest()}, 2 passed, 0 failed" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        full.main(["--shard", "2/2", "--log", str(tmp_path)])
    assert "--shard '2/2': expected i/n with 0 <= i < n" in capsys.readouterr().err


def test_the_engine_digest_changes_with_the_engine_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tmp_path / "pipeline"
    engine.mkdir()
    (engine / "__init__.py").write_text("x = 1\n")
    monkeypatch.setattr(full.gpipe_lab.pipeline, "__file__", str(engine / "__init__.py"))
    first = full.engine_digest()
    (engine / "__init__.py").write_text("x = 2\n")
    assert full.engine_digest() != first


def test_the_engine_digest_follows_a_file_moved_between_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tmp_path / "pipeline"
    (engine / "step").mkdir(parents=True)
    (engine / "stage").mkdir()
    (engine / "__init__.py").write_text("")
    (engine / "step" / "core.py").write_text("x = 1\n")
    monkeypatch.setattr(full.gpipe_lab.pipeline, "__file__", str(engine / "__init__.py"))
    first = full.engine_digest()
    (engine / "step" / "core.py").rename(engine / "stage" / "core.py")  # same name, same text, another folder
    assert full.engine_digest() != first


def test_shards_of_another_n_take_over_only_what_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(full, "design", lambda log: tiny_design())
    assert full.run_shard(tmp_path, 0, 1, limit=1) == 0  # case 0 by the one-shard job
    assert full.run_shard(tmp_path, 0, 2) == 0  # cases 0 and 2: only 2 is left to it
    assert json.loads((tmp_path / "shard-0-of-2.jsonl").read_text())["passed"] == [[2, 2]]
    assert full.run_shard(tmp_path, 1, 2) == 0
    assert full.summary(tmp_path) == 0
    assert "4 of 4 cases judged" in capsys.readouterr().out


def test_clean_drops_only_the_lines_of_other_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(full, "design", lambda log: tiny_design())
    digest = full.engine_digest()
    old = {"engine": "000000000000", "commit": "old", "shard": [0, 1], "seconds": 1.0, "passed": [[0, 1]],
           "failed": []}
    (tmp_path / "shard-0-of-15.jsonl").write_text(json.dumps(old) + "\n")  # only old lines: removed
    full.run_shard(tmp_path, 0, 2, limit=1)
    mixed = tmp_path / "shard-0-of-2.jsonl"
    mixed.write_text(json.dumps(old) + "\n" + mixed.read_text())
    assert full.clean(tmp_path, digest) == 2
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-0-of-2.jsonl"]
    assert [row["engine"] for row in _rows(tmp_path)] == [digest]
    assert full.clean(tmp_path, digest) == 0


def test_the_summary_states_the_design_and_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(full, "design", lambda log: tiny_design())
    full.run_shard(tmp_path, 0, 1)
    assert full.summary(tmp_path) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "4 cases in place of the 4 valid cases of the Cartesian product" in text
    assert "4 FOUND combinations" in text and "covering array of strength 3" in text and "(7 such tuples)" in text
    assert f"4 of 4 cases judged at engine {full.engine_digest()}, 4 passed, 0 failed" in text
    assert "load average (1 min) at the chunks' ends" in text


@pytest.mark.slow  # two shard processes start (torch and the harness imported in each): ~20 s on 2 busy cores
def test_run_all_judges_every_case_in_child_shards_and_writes_the_summary(tmp_path: Path) -> None:
    tiny_design().save(tmp_path / full.DESIGN)  # the shards load it: its key is the current one
    stale = {"engine": "000000000000", "commit": "old", "shard": [0, 1], "seconds": 1.0, "passed": [[0, 3]],
             "failed": []}
    (tmp_path / "shard-0-of-1.jsonl").write_text(json.dumps(stale) + "\n")
    assert full.main(["--run-all", "--shards", "2", "--timeout", "280", "--log", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-0-of-2.jsonl", "shard-1-of-2.jsonl"]
    assert sorted(tuple(r) for row in _rows(tmp_path) for r in row["passed"]) == [(0, 2), (1, 3)]
    assert "4 of 4 cases judged" in (tmp_path / "summary.md").read_text()


def test_run_all_stops_its_shards_at_the_timeout(tmp_path: Path) -> None:
    tiny_design().save(tmp_path / full.DESIGN)
    assert full.run_all(tmp_path, 2, timeout=0.01) == 2  # stopped before judging: cases remain
    assert "0 of 4 cases judged" in (tmp_path / "summary.md").read_text()


def test_stopping_a_shard_ends_the_processes_it_started(tmp_path: Path) -> None:
    # a shard's own children (a distributed launch's ranks) share its process group
    script = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
              "stdin=subprocess.PIPE); print(p.pid, flush=True); p.wait()")
    shard = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    grandchild = int(shard.stdout.readline())
    fd = os.pidfd_open(grandchild)
    try:
        full._stop([shard])
        assert shard.returncode == -signal.SIGTERM
        assert select.select([fd], [], [], 30)[0] == [fd], "the shard's child is still running"
    finally:
        os.close(fd)


def test_a_case_that_must_be_refused_ends_its_distributed_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # after a refusal in train_step the launch's next pipe hung in its link set-up until the timeout
    zoo = ("door=train_step,K=2,M=1,batch=3,checkpoint=except_last,schedule=gpipe,bn=none,rand=none,autocast=none,"
           "inputs=tensor,frozen=False,dtype=float32,output=tensor,track_memory=True,transport=distributed,"
           "model={},transition={},grads=none,cost=params")
    refused = [Case.parse(zoo.format("front", "short_targets")), Case.parse(zoo.format("sparse", "short_targets"))]
    passing = [Case.parse(zoo.format(m, "none")) for m in ("front", "sparse", "vit")]
    launches: list[list[str]] = []

    def run_local(worker, world, args, timeout):  # records each launch instead of starting it
        launches.append(args[0])
        raise RuntimeError("not started")

    monkeypatch.setattr(differential_distributed, "run_local", run_local)
    monkeypatch.setattr(differential_distributed, "PER_LAUNCH", 2)
    for order in ([refused[0], *passing, refused[1]], [*refused, *passing]):
        launches.clear()
        with pytest.raises(RuntimeError, match="not started"):
            differential_distributed.run_distributed(order)
        assert launches[0] == [passing[0].recipe(), passing[1].recipe(), refused[0].recipe()]
    monkeypatch.setattr(differential_distributed, "run_local", lambda worker, world, args, timeout: launches.append(
        args[0]) or [type("Rank", (), {"exitcode": 0, "value": [({}, {})] * len(args[0])})()])
    launches.clear()
    monkeypatch.setattr(differential_distributed, "merge", lambda parts: parts[0])
    assert set(differential_distributed.run_distributed([*refused, *passing])) == {*refused, *passing}
    assert launches == [[passing[0].recipe(), passing[1].recipe(), refused[0].recipe()],
                        [passing[2].recipe(), refused[1].recipe()]]


def test_a_failed_launch_is_judged_again_one_case_a_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a case failing mid-step made its launch's next pipe block until the timeout: the launch failed
    # and every distributed case of the chunk failed with it, the failing one unnamed
    cases = [Case.parse(CASES[0].recipe().replace("transport=local", "transport=distributed").replace(
        "K=2", f"K={k}")) for k in (1, 2, 3)]
    launches: list[int] = []

    def run_distributed(group: list[Case]) -> dict:
        launches.append(len(group))
        if cases[1] in group:  # a rank of this launch dies
            raise RuntimeError("rank 1 exit -9: None\ncases of this launch: ...")
        return {c: ({"error": "must pass"}, None) for c in group}

    monkeypatch.setattr(full, "run_distributed", run_distributed)
    monkeypatch.setattr(full, "judge", lambda case, got, again: [])
    judged = {case: problems for _, case, problems in full._judge_chunk(list(enumerate(cases)))}
    assert judged == {cases[0]: [], cases[1]: ["rank 1 exit -9: None"], cases[2]: []}
    assert launches == [3, 1, 1, 1]

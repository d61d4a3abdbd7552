"""The full-product runner (``differential_full.py``): a line per case, resumable, failed cases judged again."""

from __future__ import annotations

import json
from pathlib import Path

import differential_full as full
import pytest
from differential_cases import Case

from gpipe_lab.provenance import source_commit

CASES = [Case.parse(r) for r in (
    "door=train_step,K=2,M=3,batch=10,checkpoint=except_last,schedule=gpipe,bn=plain,rand=dropout,"
    "autocast=none,inputs=tensor,frozen=False,dtype=float32,output=tensor,transport=local",
    "door=backward,K=1,M=1,batch=12,checkpoint=never,schedule=gpipe,bn=none,rand=none,"
    "autocast=none,inputs=tensor,frozen=False,dtype=float32,output=dict,transport=local",  # must refuse
    "door=nograd_train,K=3,M=4,batch=12,checkpoint=never,schedule=gpipe,bn=deferred,rand=functional,"
    "autocast=bf16,inputs=tuple,frozen=True,dtype=float32,output=tensor,transport=local",
)]


def _lines(log: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(log.glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_shards_judge_every_case_once_and_resume_judging_only_what_failed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(full, "all_cases", lambda: CASES)
    assert full.run_shard(tmp_path, 0, 2) == 0 and full.run_shard(tmp_path, 1, 2) == 0
    rows = _lines(tmp_path)
    assert sorted(r["index"] for r in rows) == [0, 1, 2] and all(r["ok"] for r in rows)
    assert {r["recipe"] for r in rows} == {c.recipe() for c in CASES}
    assert {r["commit"] for r in rows} == {source_commit()}
    assert full.summary(tmp_path) == 0

    # a case recorded as failed (a launch that died, say) is judged again; passed ones are not
    path = tmp_path / "shard-0-of-2.jsonl"
    path.write_text(path.read_text() + json.dumps({"index": 2, "ok": False, "recipe": CASES[2].recipe(),
                                                   "problems": ["rank 0 exit -9: None"]}) + "\n")
    assert full.summary(tmp_path) == 1
    assert full.run_shard(tmp_path, 0, 2) == 0
    again = [r["ok"] for r in _lines(tmp_path) if r["index"] == 2]
    assert again == [True, False, True]  # judged, marked failed, judged again: the last line counts
    assert len([r for r in _lines(tmp_path) if r["index"] == 0]) == 1  # not judged twice
    assert full.summary(tmp_path) == 0


def test_summary_says_cases_remain_and_a_bad_shard_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(full, "all_cases", lambda: CASES)
    full.run_shard(tmp_path, 0, 3)
    assert full.summary(tmp_path) == 2
    assert f"1 of 3 combinations judged, 1 passed, 0 failed; judged at commit: {source_commit()} (1)" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        full.main(["--shard", "2/2", "--log", str(tmp_path)])
    assert "--shard '2/2': expected i/n with 0 <= i < n" in capsys.readouterr().err

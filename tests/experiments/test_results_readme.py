"""``results/README.md`` is generated: the committed file is exactly what ``experiments.results_readme`` writes
from the committed results (a hand edit fails), and its reviewer's verdicts follow the files they are
computed from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from experiments.results_claims import CLAIMS, VERDICTS
from experiments.results_files import Results

from experiments import results_readme

RESULTS = results_readme.RESULTS


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The committed results (but the pictures) in a folder a test may change."""
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out, ignore=shutil.ignore_patterns("*.png"))
    return out


def rewrite(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def reviewer_row(text: str, claim: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {claim} |"))


def test_the_committed_readme_is_what_the_committed_files_give() -> None:
    assert results_readme.main(["--check"]) == 0, "rerun python -m experiments.results_readme"


def test_writing_twice_gives_the_same_bytes_and_a_hand_edit_fails_the_check(copy: Path) -> None:
    out = copy / "README.md"
    assert results_readme.main(["--results", str(copy)]) == 0
    first = out.read_bytes()
    assert results_readme.main(["--results", str(copy)]) == 0
    assert out.read_bytes() == first
    out.write_text(out.read_text().replace("**partly**", "**reproduced**", 1))
    assert results_readme.main(["--results", str(copy), "--check"]) == 1


def test_every_claim_has_a_verdict_and_a_reason_with_figures() -> None:
    text = (RESULTS / "README.md").read_text()
    for claim, (_, judge) in CLAIMS.items():
        v = judge(Results(RESULTS))
        assert v.verdict in (*VERDICTS, "not computed")
        assert v.verdict == "not computed" or any(ch.isdigit() for ch in v.reason), claim
        assert f"| {claim} | **{v.verdict}** | {v.reason} |" in text


def test_the_trainability_row_applies_the_experiments_rule_to_its_runs(copy: Path) -> None:
    claim = "Trainability of deep Transformers"
    text = reviewer_row(results_readme.document(Results(copy)), claim)
    assert "| **not** | (a) shallow baselines learn in 10 of 10 (met); (b) the deepest baseline fails in 5 of 5 " \
           "(met); (c) with both fixes 0 of 5 learn (missed)" in text

    def deep_fails_shallow_learns(d: dict) -> None:
        deep = d["depths"][-1]
        for row in d["rows"]:
            for r in row["runs"]:
                if row["norm"] == "post" and row["variant"] in ("none", "both"):
                    r["learns"] = not (row["variant"] == "none" and row["layers"] == deep)

    rewrite(copy / "trainability.json", deep_fails_shallow_learns)
    assert "| **reproduced** |" in reviewer_row(results_readme.document(Results(copy)), claim)
    rewrite(copy / "trainability.json", lambda d: d.pop("rows"))
    assert "| **not computed** |" in reviewer_row(results_readme.document(Results(copy)), claim)


def test_the_overheads_verdict_follows_the_rows(copy: Path) -> None:
    claim = "§3.1 overheads"

    def hold_all(d: dict) -> None:
        for r in d["rows"]:
            r.update(recompute=0.1, imbalance=0.01, bubble_measured=r["bubble_theory"] * 0.9, update_share=0.01)

    rewrite(copy / "overheads.json", hold_all)
    assert "**reproduced**" in reviewer_row(results_readme.document(Results(copy)), claim)


def test_final_losses_are_compared_not_asserted(copy: Path) -> None:
    def same_losses(d: dict) -> None:  # each K=2 job ends where the K=1 job of its seed did
        k1, k2 = ([r for r in d["rows"] if r["K"] == k] for k in (1, 2))
        for a, b in zip(k1, k2):
            assert (a["workload"], a["M"]) == (b["workload"], b["M"])
            b["final_train_loss"] = a["final_train_loss"]

    before = results_readme.document(Results(copy))
    assert "- AmoebaNet, M=1: different" in before
    rewrite(copy / "sweeps" / "table2_throughput.json", same_losses)
    assert "- AmoebaNet, M=1: the same" in results_readme.document(Results(copy))


def test_a_compile_row_that_failed_is_listed_with_its_error(copy: Path) -> None:
    def one_fails(d: dict) -> None:
        d["compile"] = [r for r in d["compile"] if "error" not in r][:1] + [
            {"model": "amoebanet", "K": 2, "M": 32, "error": "timed out after 1800 s",
             "command": "python -m benchmarks.bench_compile --models amoebanet --chunks 32 --repeats 5"}]

    rewrite(copy / "full" / "benchmarks.json", one_fails)
    text = results_readme.document(Results(copy))
    assert "| amoebanet | 2 | 32 | — | — | — | — | ⚠ timed out after 1800 s |" in text
    assert text.count("`python -m benchmarks.bench_compile") == 2

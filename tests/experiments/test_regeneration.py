"""The regeneration check can fail: ``experiments.check_results.differences`` reports a changed
deterministic cell and ignores a timed one, and every committed tiny reference is compared by the
``--tiny`` end-to-end run of its script (``test_experiments.py``)."""

from __future__ import annotations

from pathlib import Path

from experiments.check_results import differences
from test_experiments import CASES

REFERENCES = Path(__file__).with_name("references")


def test_every_reference_is_checked_by_a_tiny_run() -> None:
    references = sorted(p.name for p in REFERENCES.glob("*.md"))
    assert references == ["table1_capacity.md", "trainability.md"]
    assert set(references) <= {name for name, _ in CASES.values()}


def test_a_changed_deterministic_cell_is_reported_and_a_timed_one_is_not() -> None:
    before = "| model | M | paper K=2 | K=2 measured |\n|---|---|---|---|\n| amoeba | 4 | 1.07 | 0.71 |\n"
    timed = before.replace("0.71", "0.93")
    changed = before.replace("1.07", "1.70")
    assert differences(timed, before) == []
    assert differences(changed, before, "t2") == ["t2 table 1 row 1 [paper K=2]: '1.70' now, '1.07' before"]
    assert "shape changed" in differences(before + "| extra | 1 | 2 | 3 |\n", before)[0]


def test_the_check_names_the_columns_it_compared_and_skipped() -> None:
    from experiments.check_results import compared_columns

    table = "| model | M | paper K=2 | K=2 measured | recorded waits (part of the bubble) |\n|---|---|---|---|---|\n"
    assert compared_columns(table) == [(["model", "M", "paper K=2"], ["K=2 measured",
                                                                     "recorded waits (part of the bubble)"])]

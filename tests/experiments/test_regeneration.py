"""The deterministic results regenerate: Table 1 and the seeded trainability table at ``--tiny`` size
match the committed references (``tests/experiments/references/``) on their deterministic columns.

Regenerate a reference after an intended change with
``python -m experiments.<name> --tiny --out tests/experiments/references`` (keep only the .md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from experiments.check_results import differences, regenerate, tables

REFERENCES = Path(__file__).with_name("references")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["table1_capacity", "trainability"])
def test_tiny_table_matches_its_reference(name: str, tmp_path: Path) -> None:
    fresh = regenerate(name, tmp_path, tiny=True, timeout=600)
    reference = (REFERENCES / f"{name}.md").read_text()
    assert tables(reference), "the reference holds no table"
    assert differences(fresh.read_text(), reference, name) == []


def test_a_changed_deterministic_cell_is_reported_and_a_timed_one_is_not() -> None:
    before = "| model | M | paper K=2 | K=2 measured |\n|---|---|---|---|\n| amoeba | 4 | 1.07 | 0.71 |\n"
    timed = before.replace("0.71", "0.93")
    changed = before.replace("1.07", "1.70")
    assert differences(timed, before) == []
    assert differences(changed, before, "t2") == ["t2 table 1 row 1 [paper K=2]: '1.70' now, '1.07' before"]
    assert "shape changed" in differences(before + "| extra | 1 | 2 | 3 |\n", before)[0]

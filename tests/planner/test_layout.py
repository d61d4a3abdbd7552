"""The planner calls the engine, never the reverse: nothing in ``pipeline/`` imports ``gpipe_lab.planner``."""

from __future__ import annotations

import ast
from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[2] / "src" / "gpipe_lab" / "pipeline"


def planner_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.startswith("gpipe_lab.planner")]
    return found


def test_the_engine_never_imports_the_planner() -> None:
    files = sorted(PIPELINE.rglob("*.py"))
    assert len(files) > 10  # the engine's files were found
    assert [hit for f in files for hit in planner_imports(f)] == []


def test_the_rule_catches_an_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from gpipe_lab.planner.search import plan_auto\n")
    assert planner_imports(bad) == ["bad.py:2 imports gpipe_lab.planner.search"]

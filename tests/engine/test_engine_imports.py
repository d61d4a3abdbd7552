"""The engine (``gpipe_lab.pipeline``) imports torch only: nothing else of the lab, never an app library.

Read from the source (every import statement, at any depth, and ``import_module("...")`` of a
constant name), so a function-level import counts as much as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpipe_lab.pipeline

ENGINE = Path(gpipe_lab.pipeline.__file__).parent
APP_LIBRARIES = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "wandb")


def imported_modules(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in ``source`` (relative ones stay in the package)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def foreign_imports(path: Path) -> list[str]:
    """``file:line module`` for each import of ``path`` that leaves the engine."""
    bad = []
    for line, module in imported_modules(path.read_text()):
        root = module.split(".")[0]
        outside_lab = root == "gpipe_lab" and not (module == "gpipe_lab.pipeline"
                                                   or module.startswith("gpipe_lab.pipeline."))
        if outside_lab or root in APP_LIBRARIES:
            bad.append(f"{path.relative_to(ENGINE.parent)}:{line} {module}")
    return bad


def test_the_reader_sees_every_kind_of_import() -> None:
    source = ("import wandb\nfrom gpipe_lab.measure import x\nfrom .stage import y\n"
              "def f():\n    from hydra import compose\n    return importlib.import_module('omegaconf')\n")
    assert sorted(imported_modules(source)) == [(1, "wandb"), (2, "gpipe_lab.measure"), (5, "hydra"), (6, "omegaconf")]


def test_the_engine_imports_nothing_of_the_lab_outside_it_and_no_app_library() -> None:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 40, files  # the whole engine, sub-packages included
    bad = [entry for path in files for entry in foreign_imports(path)]
    assert not bad, "the engine imports torch only:\n" + "\n".join(bad)

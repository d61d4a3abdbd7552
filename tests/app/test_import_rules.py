"""The layering ``docs/architecture.md`` states, read from the source (``ast``, nothing imported):
the app (``gpipe_lab/app/``) is the only importer of Hydra and OmegaConf, and nothing outside the
app imports it (``lightning`` serves the app, never the other way round)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpipe_lab

PACKAGE = Path(gpipe_lab.__file__).parent
APP = PACKAGE / "app"


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def outside_the_app() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if APP not in p.parents]


def test_imported_modules_sees_function_level_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from hydra.utils import instantiate\n    import omegaconf.errors\n")
    assert imported_modules(source) == ["os", "hydra.utils", "omegaconf.errors"]


def test_the_app_is_the_only_importer_of_hydra() -> None:
    files = outside_the_app()
    assert len(files) > 50 and any(p.parent.name == "lightning" for p in files)  # the walk found the package
    offending = [f"{p.relative_to(PACKAGE)}: {name}" for p in files for name in imported_modules(p)
                 if name.split(".")[0] in ("hydra", "omegaconf")]
    assert not offending, offending


def test_nothing_outside_the_app_imports_it() -> None:
    offending = [f"{p.relative_to(PACKAGE)}: {name}" for p in outside_the_app() for name in imported_modules(p)
                 if name == "gpipe_lab.app" or name.startswith("gpipe_lab.app.")]
    assert not offending, offending

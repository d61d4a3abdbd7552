"""The layering ``docs/architecture.md`` states, read from the source (``ast``, nothing imported):
the app (``gpipe_lab/app/``) is the only importer of Hydra and OmegaConf, nothing outside the
app imports it (``lightning`` serves the app, never the other way round), and the packages of
``gpipe_lab`` import each other in one direction only (``LAYERS``)."""

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


def package_imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """Every ``gpipe_lab`` module the file ``path`` of the package at ``root`` imports, at any depth,
    relative imports resolved (``from .x import y`` in ``planner/a.py`` is ``gpipe_lab.planner.x``)."""
    package = ["gpipe_lab", *path.relative_to(root).parts[:-1]]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            names.append(".".join(package[:len(package) - node.level + 1] + [node.module or ""]).rstrip("."))
    return [n for n in names if n.split(".")[0] == "gpipe_lab"]


#: The part of ``gpipe_lab`` a module belongs to: its top-level package, or ``FACE`` for a top-level module.
FACE = "gpipe_lab"
#: Which other parts each part may import: a DAG, the engine at the bottom, the app at the top.
LAYERS: dict[str, set[str]] = {
    "pipeline": set(),
    "models": set(),
    "data": set(),
    FACE: {"pipeline"},  # ``gpipe_lab.GPipe``, imported on first use
    "plotting": {"pipeline"},
    "planner": {"pipeline", "models"},
    "lightning": {"pipeline", "models", "data", "planner", "plotting"},
    "bench": {"pipeline", "models", "data", "planner"},  # the scripts' shared home sits above the library
    "app": {"pipeline", "models", "data", "plotting", "planner", "lightning", "bench", FACE},
}


def part_of(module: str) -> str:
    """``gpipe_lab.planner.search`` -> ``planner``; ``gpipe_lab`` -> ``FACE``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACE


def layer_violations(root: Path = PACKAGE) -> list[str]:
    """``"<file>: imports <module> (<part> may import only ...)"`` for every import of ``gpipe_lab`` under
    ``root`` that ``LAYERS`` does not allow, and for every file of a part ``LAYERS`` does not name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        part = rel.parts[0] if len(rel.parts) > 1 else FACE
        if part not in LAYERS:
            found.append(f"{rel}: part {part!r} has no row in LAYERS")
            continue
        for module in package_imports(path, root):
            target = part_of(module)
            if target != part and target not in LAYERS[part]:
                found.append(f"{rel}: imports {module} ({part} may import only {sorted(LAYERS[part])})")
    return found


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


def test_layers_form_no_cycle() -> None:
    """``LAYERS`` is a DAG (each round removes the parts that import nothing left): no import circle
    between parts can pass ``layer_violations``."""
    left = {part: set(allowed) for part, allowed in LAYERS.items()}
    assert all(allowed <= set(LAYERS) for allowed in left.values())
    while left:
        free = {part for part, allowed in left.items() if not allowed - {part}}
        assert free, f"LAYERS has a cycle among {sorted(left)}"
        left = {part: allowed - free for part, allowed in left.items() if part not in free}


def test_packages_import_each_other_in_one_direction() -> None:
    imports = {(p.relative_to(PACKAGE).parts[0], part_of(m)) for p in PACKAGE.rglob("*.py") for m in package_imports(p)}
    assert ("planner", "pipeline") in imports and ("app", "bench") in imports  # the walk saw the package
    offending = layer_violations()
    assert not offending, "\n".join(offending)


def test_layer_violations_names_the_file_and_the_import(tmp_path: Path) -> None:
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "trials.py").write_text("def f():\n    from gpipe_lab.bench import time_call\n")
    (tmp_path / "planner" / "ok.py").write_text("from . import trials\nfrom ..pipeline import GPipe\n")
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "core.py").write_text("from ..planner import search\n")
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "x.py").write_text("")
    assert layer_violations(tmp_path) == [
        "pipeline/core.py: imports gpipe_lab.planner (pipeline may import only [])",
        "planner/trials.py: imports gpipe_lab.bench (planner may import only ['models', 'pipeline'])",
        "stray/x.py: part 'stray' has no row in LAYERS",
    ]

"""How a script of ``experiments/`` or ``benchmarks/`` starts: as its module, and writing to a fresh folder.

``python experiments/table2_throughput.py`` puts ``experiments/`` first on the import path, not the
repository root, so ``from experiments.common import ...`` fails. Each script therefore starts with

    if not __package__:  # started as a file: rerun as the module
        from gpipe_lab.bench.script_launch import rerun_as_module

        rerun_as_module(__file__)

``fresh_out`` names the folder a run writes to unless told ``--out results``, so that
trying a script never overwrites a committed result. This module imports nothing
heavy: it runs before torch is loaded.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path


def module_of(file: str | Path) -> tuple[str, Path]:
    """The dotted module name of ``file`` and the folder above its outermost package.

    Raises:
        ValueError: ``file`` is not inside a package (no ``__init__.py`` beside it).
    """
    path = Path(file).resolve()
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1:
        raise ValueError(f"{path} is not inside a package (no __init__.py beside it)")
    return ".".join(parts), folder


def rerun_as_module(file: str | Path) -> None:
    """Replace this process with ``python -m <module of file>``, the same arguments, from any folder.

    The package's root is put first on ``PYTHONPATH``; the working directory is kept. Does not return.

    Raises:
        ValueError: ``file`` is not inside a package.
        OSError: the interpreter could not be started.
    """
    module, root = module_of(file)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})


def fresh_out(base: Path, script: str | None = None, now: datetime.datetime | None = None) -> Path:
    """A folder no run has used: ``base/<script>/<YYYY-mm-dd_HH-MM-SS>`` (``-1``, ``-2``, ... if taken).

    ``script`` defaults to the running script's name; the folder is not created.
    """
    name = script or Path(sys.argv[0]).stem or "run"
    first = base / name / (now or datetime.datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")
    path, n = first, 1
    while path.exists():
        path, n = first.with_name(f"{first.name}-{n}"), n + 1
    return path

"""Read the files of ``results/`` for ``experiments.results_readme``: JSON, markdown tables, and the
small statistics every comparison of repeated runs prints (mean, range, count).

Nothing here measures anything; every value comes from a file a script wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpipe_lab.bench.markdown import read_tables as tables

#: fewer runs per arm than this and a comparison says so
SEEDS_NEEDED = 5


class Results:
    """The files of one ``results/`` folder (``root``), read on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def exists(self, name: str) -> bool:
        """Whether ``root/name`` is there."""
        return (self.root / name).exists()

    def json(self, name: str) -> Any:
        """``root/name`` parsed.

        Raises:
            FileNotFoundError: no such file under ``root``.
        """
        return json.loads((self.root / name).read_text())

    def text(self, name: str) -> str:
        """``root/name`` as text ('' when it is missing)."""
        path = self.root / name
        return path.read_text() if path.exists() else ""

    def table(self, name: str, index: int = 0) -> tuple[list[str], list[list[str]]]:
        """The ``index``-th markdown table of ``root/name`` as (header, rows); empty when there is none."""
        found = tables(self.text(name))
        return found[index] if index < len(found) else ([], [])

    def bullets(self, name: str) -> list[str]:
        """The top-level bullet lines (``- ...``) of ``root/name``: the findings its script computed."""
        return [line[2:].strip() for line in self.text(name).splitlines() if line.startswith("- ")]


def mean(values: Iterable[float]) -> float:
    """The arithmetic mean.

    Raises:
        ValueError: no values.
    """
    v = list(values)
    if not v:
        raise ValueError("mean of no values")
    return sum(v) / len(v)


def arm(values: Iterable[float], digits: int = 2) -> str:
    """``mean [min, max] (n=N)`` of one arm's runs, with a warning when N < ``SEEDS_NEEDED``."""
    v = list(values)
    text = f"{mean(v):.{digits}f} [{min(v):.{digits}f}, {max(v):.{digits}f}] (n={len(v)})"
    return text + (f" ⚠ n < {SEEDS_NEEDED}" if len(v) < SEEDS_NEEDED else "")


def number(text: str) -> float | None:
    """The first number of a cell such as ``'1.05B'``, ``'319.0M'``, ``'81,505,540 (81.5M)'`` or ``'23%'``,
    scaled by its suffix (k, M, B, %); None when the cell has none."""
    m = re.search(r"(-?[\d,]*\.?\d+)\s*([kMB%]?)", text)
    if not m:
        return None
    value = float(m.group(1).replace(",", ""))
    return value * {"k": 1e3, "M": 1e6, "B": 1e9, "%": 0.01, "": 1.0}[m.group(2)]


def printed_unit(text: str) -> float:
    """One unit of the last digit a figure such as ``'1.05B'`` or ``'318M'`` is printed with."""
    m = re.search(r"(\d+)(?:\.(\d+))?\s*([kMB]?)", text)
    if not m:
        raise ValueError(f"no figure in {text!r}")
    return 10.0 ** -len(m.group(2) or "") * {"k": 1e3, "M": 1e6, "B": 1e9, "": 1.0}[m.group(3)]


def row_of(rows: list[list[Any]], label: str) -> list[Any]:
    """The row of a JSON or markdown table whose first cell is ``label``.

    Raises:
        KeyError: no such row.
    """
    for r in rows:
        if str(r[0]).strip() == label.strip():
            return r
    raise KeyError(f"no row {label!r}; rows: {[r[0] for r in rows]}")

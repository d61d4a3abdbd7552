"""The one markdown-table writer of the experiments, the benchmarks and the sweep summary."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def md_table(header: Sequence[object], rows: Sequence[Sequence[object]],
             cell: Callable[[object], str] = str) -> str:
    """A GitHub markdown table, each body cell written by ``cell`` (default ``str``); no trailing newline.

    Raises:
        ValueError: a row whose length differs from the header's (the row's index and both lengths).
    """
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"markdown table row {i} has {len(row)} cells; the header has {len(header)}")
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)

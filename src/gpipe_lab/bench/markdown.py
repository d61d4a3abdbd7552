"""The one markdown-table writer of the experiments, the benchmarks and the sweep summary, and its reader."""

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


def read_tables(markdown: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every GitHub markdown table of ``markdown`` as (header, rows of cells)."""
    found: list[tuple[list[str], list[list[str]]]] = []
    block: list[list[str]] = []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            if len(block) >= 2 and all(set(c) <= set("-: ") for c in block[1]):
                found.append((block[0], block[2:]))
            block = []
    return found

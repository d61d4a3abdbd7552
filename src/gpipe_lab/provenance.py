"""The commit of the code that ran: each gpipe-train job records it in its summary.json."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

#: The checkout this package was imported from (an editable install or a source tree).
SOURCE_ROOT = Path(__file__).resolve().parents[2]


@cache
def source_commit(root: Path = SOURCE_ROOT) -> str:
    """``commit_of(root)``, read once per process (the code a run imported)."""
    return commit_of(root)


def commit_of(root: Path) -> str:
    """HEAD of the git checkout at ``root`` (12 hex digits), ``+dirty`` when tracked files outside
    ``results/`` differ from it, ``unknown`` outside a git checkout or without git. Never raises."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)results"], capture_output=True, text=True, check=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"

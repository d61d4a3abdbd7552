"""The commit of the code that ran: each gpipe-train job records it in its summary.json, each script
of benchmarks/ and experiments/ in its results (imported by the app and by the scripts alike)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

#: The checkout this package was imported from (an editable install or a source tree).
SOURCE_ROOT = Path(__file__).resolve().parents[3]


@cache
def source_commit(root: Path = SOURCE_ROOT) -> str:
    """``commit_of(root)``, read once per process (the code a run imported)."""
    return commit_of(root)


#: what a result does not depend on: the results themselves, Markdown prose (README, docs) and the tests
#: (``test_*.py``, ``conftest.py``: they check the code and make no result; the harnesses and helpers beside
#: them, such as ``tests/engine/differential_full.py``, which writes ``results/differential``, stay source)
NOT_SOURCE = (":(exclude)results", ":(exclude)*.md", ":(exclude,glob)tests/**/test_*.py",
              ":(exclude,glob)tests/**/conftest.py")


def commit_of(root: Path) -> str:
    """The source commit of the git checkout at ``root`` (12 hex digits): the last commit that changed
    a file other than ``results/``, Markdown and the tests (``NOT_SOURCE``), so that committing results,
    prose or tests between the jobs of one regeneration leaves them at one commit; ``+dirty`` when such
    tracked files differ from it; ``unknown`` outside a git checkout or without git. Never raises."""
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run([*git, "log", "-1", "--format=%H", "--", ".", *NOT_SOURCE], capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()[:12]
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_SOURCE],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"

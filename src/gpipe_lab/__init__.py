"""GPipe Lab: pipeline-parallel training after Huang et al. (2019).

``gpipe_lab.GPipe`` is the engine's front door; it is imported on first use, so that
``import gpipe_lab.data`` (or ``.models``) does not load the engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GPipe"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import ``GPipe`` lazily.

    Raises:
        AttributeError: any other name.
    """
    if name == "GPipe":
        from gpipe_lab.pipeline import GPipe

        return GPipe
    raise AttributeError(f"module 'gpipe_lab' has no attribute {name!r}")

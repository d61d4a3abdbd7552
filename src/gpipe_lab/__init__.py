"""GPipe Lab: pipeline-parallel training after Huang et al. (2019)."""

from gpipe_lab.pipeline import GPipe

__all__ = ["GPipe"]
__version__ = "0.1.0"

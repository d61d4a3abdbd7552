"""Long skip connections across stages: ``@skippable``, ``stash``, ``pop`` (torchgpipe's idea).

``api``: what a layer calls; ``layout``: which stage each skip leaves and reaches, checked at
construction; ``transport``: the skip messages a step sends straight between those stages.
"""

from gpipe_lab.pipeline.skip.api import SkipError, isolate, pop, skippable, stash
from gpipe_lab.pipeline.skip.layout import SkipLayout, skip_layout

__all__ = ["SkipError", "SkipLayout", "isolate", "pop", "skip_layout", "skippable", "stash"]

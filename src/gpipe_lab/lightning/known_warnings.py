"""Library warnings known to be harmless in ``gpipe-train``, silenced one by one.

Each entry is matched by its category (or for a logged warning, its logger) AND the start of
its message, so any other warning (a new deprecation, advice that applies) still reaches the user.
"""

from __future__ import annotations

import logging
import re
import warnings

from lightning.fabric.utilities.warnings import PossibleUserWarning

#: (category, regex of the message's start, why it is harmless here).
KNOWN_HARMLESS: list[tuple[type[Warning], str, str]] = [
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated",
     "raised inside Lightning's own pytree helper on every batch; nothing a user can change"),
    (PossibleUserWarning, r"It is recommended to use `self\.log\('(val|test)/[^']*', \.\.\., sync_dist=True\)`",
     "evaluation outputs are broadcast to every stage of the pipeline, so each rank logs the same value"),
    (UserWarning, r"The dirpath has changed from .* therefore `best_model_score`",
     "every run writes its own checkpoints folder: resuming another run's checkpoint is how gpipe-train resumes"),
]


#: (logger, regex of the message's start, why it is harmless here): warnings logged, not warned.
KNOWN_HARMLESS_LOGS: list[tuple[str, str, str]] = [
    ("torch.utils.cpp_extension", r"No CUDA runtime is found",
     "logged when torch.compile's Inductor imports torch.utils.cpp_extension on a machine with a CUDA "
     "toolkit but no GPU; a CPU run compiles C++ and never uses CUDA_HOME"),
]


class DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(str(record.msg))


def silence_known_warnings() -> None:
    """Install an ``ignore`` filter for each ``KNOWN_HARMLESS`` entry and a ``DropMessage`` filter on
    each ``KNOWN_HARMLESS_LOGS`` logger (process-wide, once)."""
    for category, message, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, message, _why in KNOWN_HARMLESS_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) and f.pattern.pattern == message for f in logger.filters):
            logger.addFilter(DropMessage(message))

"""Library warnings known to be harmless in ``gpipe-train``, silenced one by one.

Each entry is matched by its category AND the start of its message, so any other warning
(a new deprecation, advice that applies) still reaches the user.
"""

from __future__ import annotations

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


def silence_known_warnings() -> None:
    """Install an ``ignore`` filter for each ``KNOWN_HARMLESS`` entry (process-wide)."""
    for category, message, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)

"""Only the known-harmless library warnings are silenced, by category and message."""

from __future__ import annotations

import warnings

from lightning.fabric.utilities.warnings import PossibleUserWarning

from gpipe_lab.lightning.known_warnings import silence_known_warnings

SYNC_ADVICE = ("It is recommended to use `self.log('{key}', ..., sync_dist=True)` when logging on epoch level in "
               "distributed setting to accumulate the metric across devices.")


def shown(*emitted: tuple[str, type[Warning]]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_known_warnings()
        for message, category in emitted:
            warnings.warn(message, category, stacklevel=1)
    return [str(w.message) for w in caught]


def test_known_messages_are_silenced_and_others_still_show() -> None:
    leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    assert shown((leaf, FutureWarning), (SYNC_ADVICE.format(key="val/loss"), PossibleUserWarning)) == []
    others = [
        (leaf, DeprecationWarning),  # same text, another category
        ("`something_else` is deprecated", FutureWarning),  # same category, another message
        (SYNC_ADVICE.format(key="train/epoch_loss"), PossibleUserWarning),  # a metric the strategy does not share
    ]
    assert shown(*others) == [message for message, _ in others]

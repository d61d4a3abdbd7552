"""How a mini-batch becomes one step's micro-batches: M, the feed, the loss weights, checkpointing.

A batch smaller than ``chunks`` runs as that many one-sample micro-batches, so a
short last batch of an epoch trains like the others.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from gpipe_lab.pipeline.channel import StepFeed
from gpipe_lab.pipeline.microbatch import as_tuple, batch_size, split, unwrap
from gpipe_lab.pipeline.options import CHECKPOINT_MODES

Normalizer = Callable[[object], "Tensor | float"]


def checkpointed_microbatches(mode: str, num_microbatches: int) -> frozenset[int]:
    """Micro-batches whose activations are re-materialized in backward.

    Raises:
        ValueError: unknown mode.
    """
    if mode == "always":
        return frozenset(range(num_microbatches))
    if mode == "except_last":
        return frozenset(range(num_microbatches - 1))
    if mode == "never":
        return frozenset()
    raise ValueError(f"checkpoint: must be one of {list(CHECKPOINT_MODES)}, got {mode!r}")


def microbatch_count(chunks: int, inputs: object, targets: object) -> int:
    """min(chunks, batch), the batch read from the inputs, else the targets, else ``chunks``.

    Raises:
        TypeError, ValueError: the values are not tensors or disagree on the batch size.
    """
    for value, name in ((inputs, "inputs"), (targets, "targets")):
        if value is not None:
            return max(1, min(chunks, batch_size(as_tuple(value, name), name)))
    return chunks


def make_feed(inputs: object, targets: object, num_microbatches: int, first_here: bool,
              last_here: bool) -> StepFeed:
    """The micro-batches this process's first and last stages read (``None`` where absent).

    Raises:
        TypeError, ValueError: values that are not tensors or cannot be split in M.
    """
    micro_inputs = None
    if inputs is not None and first_here:
        micro_inputs = split(as_tuple(inputs, "inputs"), num_microbatches, "inputs")
    micro_targets = None
    if targets is not None and last_here:
        micro_targets = [unwrap(t, isinstance(targets, Tensor))
                         for t in split(as_tuple(targets, "targets"), num_microbatches, "targets")]
    return StepFeed(micro_inputs, isinstance(inputs, Tensor), micro_targets)


def loss_weights(inputs: object, targets: object, num_microbatches: int,
                 loss_normalizer: Normalizer | None) -> list[float]:
    """Each micro-batch's loss weight: its share of the batch, or 1 / ``loss_normalizer(targets)``.

    Raises:
        ValueError: neither inputs nor targets, or a normalizer that is not positive.
    """
    ref, name = (inputs, "inputs") if inputs is not None else (targets, "targets")
    if ref is None:
        raise ValueError("this rank runs the last stage: train_step needs targets")
    sizes = [mb[0].shape[0] for mb in split(as_tuple(ref, name), num_microbatches, name)]
    if loss_normalizer is None:
        return [s / sum(sizes) for s in sizes]
    total = float(loss_normalizer(targets))
    if not total > 0:
        raise ValueError(f"loss_normalizer returned {total}; it must be positive")
    return [1.0 / total] * num_microbatches

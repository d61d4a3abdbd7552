"""How a mini-batch becomes one step's micro-batches: M, the feed, the loss weights, checkpointing.

A batch smaller than ``chunks`` runs as that many one-sample micro-batches, so a
short last batch of an epoch trains like the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gpipe_lab.pipeline.devices.assignment import to_device
from gpipe_lab.pipeline.microbatch import as_tuple, batch_size, split, unwrap
from gpipe_lab.pipeline.options import CHECKPOINT_MODES
from gpipe_lab.pipeline.step.channel import StepFeed

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

    Given both, inputs and targets must agree on the batch size, as plain PyTorch's loss
    does: split into micro-batches, targets of another size would broadcast against the
    outputs silently.

    Raises:
        TypeError, ValueError: the values are not tensors, disagree on the batch size among
            themselves, or the targets' batch size is not the inputs'.
    """
    batch = None if inputs is None else batch_size(as_tuple(inputs, "inputs"), "inputs")
    if targets is not None:
        rows = batch_size(as_tuple(targets, "targets"), "targets")
        if batch is not None and rows != batch:
            raise ValueError(f"targets have batch size {rows} but inputs have {batch}: train_step "
                             "needs one target row per input row (dim 0 of both)")
        batch = rows
    return chunks if batch is None else max(1, min(chunks, batch))


def input_leaves(inputs: tuple[Tensor, ...], num_microbatches: int,
                 device: torch.device) -> list[tuple[Tensor, ...]]:
    """Each micro-batch's inputs as leaves of its own on ``device`` (needing grad as the input does).

    The stages' graphs end at these leaves; the caller's graph behind the inputs is then
    back-propagated once, from the leaves' joined gradients (``input_gradients``), as one
    plain backward would: a backward per micro-batch through a graph of the caller's would
    free its saved tensors at the first.

    Raises:
        TypeError, ValueError: inputs that cannot be split in M.
    """
    return [tuple(t.detach().to(device).requires_grad_(t.requires_grad) for t in mb)
            for mb in split(inputs, num_microbatches, "inputs")]


def input_gradients(devices: list[torch.device], leaves: list[tuple[Tensor, ...]]) -> list[Tensor | None]:
    """The gradient of each input from its micro-batch leaves' (``None`` if one of them got none),
    on ``devices[j]``, input j's device."""
    grads: list[Tensor | None] = []
    for j, device in enumerate(devices):
        pieces = [g for mb in leaves if (g := mb[j].grad) is not None]
        grads.append(None if len(pieces) < len(leaves) else torch.cat(pieces).to(device))
    return grads


def make_feed(inputs: object, targets: object, num_microbatches: int, first_here: bool,
              last_here: bool, leaves_on: torch.device | None = None) -> StepFeed:
    """The micro-batches this process's first and last stages read (``None`` where absent);
    with ``leaves_on``, the inputs' micro-batches are ``input_leaves`` on that device.

    Raises:
        TypeError, ValueError: values that are not tensors or cannot be split in M.
    """
    micro_inputs = None
    if inputs is not None and first_here:
        values = as_tuple(inputs, "inputs")
        micro_inputs = (split(values, num_microbatches, "inputs") if leaves_on is None
                        else input_leaves(values, num_microbatches, leaves_on))
    micro_targets = None
    if targets is not None and last_here:
        micro_targets = [unwrap(t, isinstance(targets, Tensor))
                         for t in split(as_tuple(targets, "targets"), num_microbatches, "targets")]
    return StepFeed(micro_inputs, isinstance(inputs, Tensor), micro_targets)


def loss_weights(inputs: object, targets: object, num_microbatches: int,
                 loss_normalizer: Normalizer | None, device: torch.device | None = None) -> list[float | Tensor]:
    """Each micro-batch's loss weight: its share of the batch, or 1 / ``loss_normalizer(targets)``.

    A normalizer that returns a tensor (``count_tokens``: on the targets' device) is never read
    here, which would stall the host before the first launch: the weight stays a float64
    tensor, NaN where the count is not positive, so the step's loss is NaN and its verdict
    reports it; it is moved to ``device`` (the last stage's) once for all micro-batches.

    Raises:
        ValueError: neither inputs nor targets, or a normalizer number that is not positive.
    """
    ref, name = (inputs, "inputs") if inputs is not None else (targets, "targets")
    if ref is None:
        raise ValueError("this rank runs the last stage: train_step needs targets")
    sizes = [mb[0].shape[0] for mb in split(as_tuple(ref, name), num_microbatches, name)]
    if loss_normalizer is None:
        return [s / sum(sizes) for s in sizes]
    count = loss_normalizer(targets)
    if isinstance(count, Tensor):
        count = count.detach().reshape(()).double()
        weight = torch.where(count > 0, count.reciprocal(), torch.nan)
        return [weight if device is None else to_device(weight, device)] * num_microbatches
    total = float(count)
    if not total > 0:
        raise ValueError(f"loss_normalizer returned {total}; it must be positive")
    return [1.0 / total] * num_microbatches

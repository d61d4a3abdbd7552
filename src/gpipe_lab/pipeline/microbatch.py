"""Splitting a mini-batch into micro-batches and joining the outputs back.

Values between partitions are a tensor or a tuple of tensors. Internally the
engine always carries tuples; ``unwrap`` turns a 1-tuple back into the tensor
the user's layer expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor

Value = Union[Tensor, tuple[Tensor, ...]]


def as_tuple(value: object, where: str) -> tuple[Tensor, ...]:
    """Normalize a boundary value to a tuple of tensors.

    Raises:
        TypeError: the value (or an element of a tuple) is not a tensor; the
            message names ``where`` it came from.
    """
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value:
        for i, item in enumerate(value):
            if not isinstance(item, Tensor):
                raise TypeError(
                    f"{where}: element {i} is {type(item).__name__}; values between partitions "
                    "must be a tensor or a tuple of tensors"
                )
        return tuple(value)
    raise TypeError(
        f"{where}: got {type(value).__name__}; values between partitions must be a tensor "
        "or a non-empty tuple of tensors"
    )


def final_output(value: object, microbatch: int) -> tuple[Tensor, ...]:
    """The last partition's output as a tuple of tensors, for the calls that join it.

    Raises:
        TypeError: it is not a tensor nor a tuple of tensors (``train_step`` without
            ``return_outputs`` takes any value its ``loss_fn`` reads).
    """
    try:
        return as_tuple(value, "")
    except TypeError:
        raise TypeError(
            f"the last partition's output (micro-batch {microbatch}) is a {type(value).__name__}; "
            "pipe(x) and train_step(..., return_outputs=True) join it across micro-batches, so it must "
            "be a tensor or a tuple of tensors (train_step(x, y, loss_fn) takes any value loss_fn reads)"
        ) from None


def unwrap(values: tuple[Tensor, ...], was_tensor: bool) -> Value:
    """Give a layer back the shape of value it produced: a tensor or a tuple."""
    return values[0] if was_tensor else values


def batch_size(values: tuple[Tensor, ...], where: str) -> int:
    """The common size of dim 0.

    Raises:
        ValueError: tensors disagree on dim 0, or a tensor is 0-dimensional.
    """
    sizes = set()
    for t in values:
        if t.dim() == 0:
            raise ValueError(f"{where}: a 0-dimensional tensor cannot be split into micro-batches")
        sizes.add(t.shape[0])
    if len(sizes) != 1:
        raise ValueError(f"{where}: tensors disagree on the batch dimension: sizes {sorted(sizes)}")
    return sizes.pop()


def split(values: tuple[Tensor, ...], chunks: int, where: str) -> list[tuple[Tensor, ...]]:
    """Split every tensor on dim 0 into ``chunks`` nearly equal micro-batches.

    Uneven splits are allowed (the first ``N % M`` micro-batches get one more
    sample, as ``torch.tensor_split`` does).

    Raises:
        ValueError: ``chunks`` is below 1 or above the batch size.
    """
    n = batch_size(values, where)
    if chunks < 1 or chunks > n:
        raise ValueError(f"chunks must be between 1 and the batch size {n} ({where}), got {chunks}")
    parts = [torch.tensor_split(t, chunks, dim=0) for t in values]
    return [tuple(p[i] for p in parts) for i in range(chunks)]


def join(microbatches: Sequence[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """Concatenate micro-batch outputs back into one batch (elementwise for tuples)."""
    width = len(microbatches[0])
    return tuple(torch.cat([mb[j] for mb in microbatches], dim=0) for j in range(width))


def to_device(values: tuple[Tensor, ...], device: torch.device) -> tuple[Tensor, ...]:
    """Move a tuple of tensors to ``device`` (a no-op for tensors already there).

    Blocking to the CPU: a non-blocking GPU-to-CPU copy could be read before it lands.
    """
    blocking = torch.device(device).type == "cpu"
    return tuple(t if t.device == device else t.to(device, non_blocking=not blocking) for t in values)


def nbytes(values: Sequence[Tensor]) -> int:
    """Bytes held by the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in values)

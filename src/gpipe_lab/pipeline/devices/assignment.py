"""Device resolution and placement: which device each pipeline rank uses, and moving targets there.

Placement follows what the caller asked for: with no ``devices`` every rank is
on the CPU, even on a machine with GPUs (a CPU run must not land on a GPU
nobody asked for). ``"cuda"`` without an index means the current CUDA device,
as ``torch.cuda.current_device()`` says, so ``devices=["cuda"] * K`` puts every
stage on one GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["move_target", "normalize_device", "resolve_devices", "to_device"]


def normalize_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` with an explicit index for CUDA.

    Raises:
        ValueError: ``device`` is not a device string, or names CUDA when CUDA is not
            available, or a CUDA index beyond the visible GPUs.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device (expected e.g. 'cpu', 'cuda', 'cuda:1')") from exc
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asks for CUDA, but CUDA is not available here; use 'cpu'")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {device!r}: this machine has {count} visible CUDA device(s), "
                         f"indices 0..{count - 1}")
    return torch.device("cuda", index)


def resolve_devices(devices: Sequence[str | torch.device] | None, partitions: int) -> list[torch.device]:
    """One device per partition: the given ones (``"cuda"`` resolved to an index), default CPU.

    Raises:
        ValueError: fewer devices than partitions, or a device that cannot be used
            (see ``normalize_device``).
    """
    if devices is None:
        return [torch.device("cpu")] * partitions
    if len(devices) < partitions:
        raise ValueError(f"{partitions} partitions need {partitions} devices, got {len(devices)}: "
                         f"{[str(d) for d in devices]}")
    return [normalize_device(d) for d in list(devices)[:partitions]]


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``; a copy to the CPU is blocking, so it can be read at once.

    A non-blocking copy to a GPU is ordered on that GPU's stream before any use
    there. A non-blocking copy from a GPU to the CPU returns before the data has
    arrived, and the host reads it with nothing to wait on: it is only made
    blocking there.
    """
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=torch.device(device).type != "cpu")


def move_target(target: object, device: torch.device) -> object:
    """``target`` with its tensors on ``device`` (tuples, lists and dicts walked; the rest as is)."""
    if isinstance(target, Tensor):
        return to_device(target, device)
    if isinstance(target, tuple):
        return tuple(move_target(t, device) for t in target)
    if isinstance(target, list):
        return [move_target(t, device) for t in target]
    if isinstance(target, dict):
        return {k: move_target(v, device) for k, v in target.items()}
    return target

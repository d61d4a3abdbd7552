"""Tensor tuples over a ``multiprocessing`` connection: a small pickled header, then each
tensor's bytes sent straight from its memory and received straight into a new tensor.

Used by the process mode of the local transport for boundary values and the first
stage's inputs; the bytes are copied exactly, so a value arrives bitwise as it was sent.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import Tensor

Values = tuple[Tensor | None, ...]


def _raw(tensor: Tensor) -> Any:
    """The tensor's bytes as a writable buffer over its own memory (a contiguous CPU tensor)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def send_values(conn: Connection, tag: Any, values: Values, was_tensor: bool) -> None:
    """Send ``values`` (CPU tensors or ``None``) with ``tag`` and ``was_tensor``.

    Raises:
        ValueError: a tensor not on the CPU.
        OSError: the receiving process is gone (``BrokenPipeError``).
    """
    tensors = []
    specs: list[tuple[tuple[int, ...], torch.dtype] | None] = []
    for v in values:
        if v is None:
            specs.append(None)
            continue
        if v.device.type != "cpu":
            raise ValueError(f"the process mode hands over CPU tensors only, got one on {v.device}")
        tensors.append(v.detach().contiguous())
        specs.append((tuple(v.shape), v.dtype))
    conn.send((tag, specs, was_tensor))
    for t in tensors:
        if t.numel():
            conn.send_bytes(_raw(t))


def recv_values(conn: Connection) -> tuple[Any, Values, bool]:
    """Receive what ``send_values`` sent: ``(tag, values, was_tensor)``.

    Raises:
        EOFError, OSError: the sending process is gone.
    """
    tag, specs, was_tensor = conn.recv()
    values: list[Tensor | None] = []
    for spec in specs:
        if spec is None:
            values.append(None)
            continue
        shape, dtype = spec
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            conn.recv_bytes_into(_raw(t))
        values.append(t)
    return tag, tuple(values), was_tensor

"""Boundary values on the wire: a metadata header, then one message per tensor.

Shapes are never frozen: each message starts with an int64 header describing
what follows, so the batch size or sequence length may change every step::

    [length, count, was_tensor, (present, dtype, requires_grad, ndim, *shape) × count]

The header has a fixed part of ``HEADER_SLOTS`` int64; a longer header
continues in a second message. Tags: message ``seq`` of a link uses
``seq·TAGS_PER_MESSAGE + part`` (part 0: header, 1: header continuation,
2+j: tensor j), so gloo can never match two messages of a link with each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe_lab.pipeline.distributed.failure import link_error

HEADER_SLOTS = 32
TAGS_PER_MESSAGE = 1024
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODES = {dt: i for i, dt in enumerate(_DTYPES)}


class PeerWork:
    """The Work of a send, with the rank it goes to (so that a failure names it)."""

    __slots__ = ("work", "peer")

    def __init__(self, work: dist.Work, peer: int) -> None:
        self.work, self.peer = work, peer

    def wait(self) -> bool:
        return self.work.wait()

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


Values = tuple[Tensor | None, ...]
Pending = list[tuple[PeerWork, Tensor]]  # (Work, the tensor it reads or writes: kept alive until done)
WaitFn = Callable[[dist.Work, str], object]


def encode_header(values: Values, was_tensor: bool) -> list[int]:
    """Describe a tuple of tensors (``None`` entries allowed) as a list of ints.

    Raises:
        TypeError: a dtype that cannot travel, or more tensors than the tag space holds.
    """
    if len(values) > TAGS_PER_MESSAGE - 2:
        raise TypeError(f"cannot send {len(values)} tensors in one boundary value "
                        f"(at most {TAGS_PER_MESSAGE - 2})")
    body = [len(values), int(was_tensor)]
    for t in values:
        if t is None:
            body += [0, 0, 0, 0]
            continue
        if t.dtype not in _CODES:
            raise TypeError(f"tensors of dtype {t.dtype} cannot cross a pipeline boundary")
        body += [1, _CODES[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return [len(body) + 1, *body]


def decode_header(header: list[int]) -> tuple[list[tuple[torch.dtype, tuple[int, ...], bool] | None], bool]:
    """Inverse of ``encode_header``: per entry (dtype, shape, requires_grad) or None."""
    count, was_tensor, pos = header[1], bool(header[2]), 3
    specs: list[tuple[torch.dtype, tuple[int, ...], bool] | None] = []
    for _ in range(count):
        present, code, grad, ndim = header[pos:pos + 4]
        pos += 4
        if not present:
            specs.append(None)
            continue
        specs.append((_DTYPES[code], tuple(header[pos:pos + ndim]), bool(grad)))
        pos += ndim
    return specs, was_tensor


def _wire(t: Tensor) -> Tensor:
    """The tensor as it travels: contiguous, bool as uint8."""
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def send_values(values: Values, was_tensor: bool, dst: int, group: dist.ProcessGroup, seq: int,
                header_device: torch.device, header_group: dist.ProcessGroup | None = None) -> Pending:
    """Start sending a boundary value; returns the Work handles (with their tensors) to keep.

    The header goes over ``header_group`` (default: ``group``) as ``header_device`` tensors.

    Raises:
        PeerFailedError: the link to ``dst`` is closed (``dst`` went away), naming ``dst``.
    """
    words = encode_header(values, was_tensor)
    fixed = words[:HEADER_SLOTS] + [0] * max(0, HEADER_SLOTS - len(words))
    base = seq * TAGS_PER_MESSAGE
    parts = [torch.tensor(fixed, dtype=torch.int64, device=header_device)]
    if len(words) > HEADER_SLOTS:
        parts.append(torch.tensor(words[HEADER_SLOTS:], dtype=torch.int64, device=header_device))
    headers = group if header_group is None else header_group
    sends = [(tensor, base + part, headers) for part, tensor in enumerate(parts)]
    sends += [(_wire(t), base + 2 + j, group) for j, t in enumerate(values) if t is not None]
    pending: Pending = []
    for tensor, tag, on in sends:
        try:
            work = dist.isend(tensor, dst=dst, group=on, tag=tag)
        except RuntimeError as exc:  # gloo raises here once the peer's connection is closed
            raise link_error(f"sending to rank {dst}", dst, exc) from exc
        pending.append((PeerWork(cast(dist.Work, work), dst), tensor))  # None only off the group
    return pending


def recv_values(src: int, group: dist.ProcessGroup, seq: int, device: torch.device, header_device: torch.device,
                wait: WaitFn, header_group: dist.ProcessGroup | None = None) -> tuple[Values, bool]:
    """Receive one boundary value; ``wait(work, what)`` blocks until a Work completes
    (for NCCL data: until the calling thread's current stream is ordered after it).

    The header comes over ``header_group`` (default: ``group``) into ``header_device`` tensors.
    """
    base = seq * TAGS_PER_MESSAGE
    headers = group if header_group is None else header_group
    fixed = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=header_device)
    wait(cast(dist.Work, dist.irecv(fixed, src=src, group=headers, tag=base)), "header")  # None: off the group
    words = fixed.tolist()
    if words[0] > HEADER_SLOTS:
        rest = torch.empty(words[0] - HEADER_SLOTS, dtype=torch.int64, device=header_device)
        wait(cast(dist.Work, dist.irecv(rest, src=src, group=headers, tag=base + 1)), "header")
        words = words + rest.tolist()
    specs, was_tensor = decode_header(words)
    buffers: list[Tensor | None] = []
    works: list[dist.Work] = []
    for j, spec in enumerate(specs):
        if spec is None:
            buffers.append(None)
            continue
        dtype, shape, _ = spec
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        buf = torch.empty(shape, dtype=wire_dtype, device=device)
        works.append(cast(dist.Work, dist.irecv(buf, src=src, group=group, tag=base + 2 + j)))
        buffers.append(buf)
    for work in works:
        wait(work, "data")
    values = tuple(None if b is None or spec is None else _restore(b, *spec)
                   for b, spec in zip(buffers, specs))
    return values, was_tensor


def _restore(buf: Tensor, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool) -> Tensor:
    t = buf.view(torch.bool) if dtype == torch.bool else buf
    return t.requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))

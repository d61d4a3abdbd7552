"""Streams of the local transport: each rank computes on its own stream, hand-overs copy on another.

Without this, every stage on a GPU would run on its device's default stream,
so a hand-over copy would queue behind every forward already launched there
and stages sharing a GPU would serialize. As in torchgpipe:

- ``compute(rank)``: the stream a rank's worker thread makes current for all its work;
- ``mark(rank)``: after a rank produced values to send, an event on its compute stream;
- ``hand_over(values, mark, rank, device)``: the receiver's copy stream waits for the
  mark, copies, and the receiver's compute stream waits for the copy; ``record_stream``
  tells the caching allocator which streams still use each tensor;
- ``begin`` / ``finish``: compute streams wait for the caller's stream (the optimizer
  updated the parameters there), and the caller's stream waits for them at the end.

``NoStreams`` is the CPU's (plain copies, nothing to order); ``CudaStreams`` the GPU's.
A test can pass its own object with these methods to watch the plumbing.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor

Values = tuple[Tensor | None, ...]


class Streams(Protocol):
    """The device interface the local transport drives (see the module docstring)."""

    def compute(self, rank: int, device: torch.device) -> AbstractContextManager[Any]: ...

    def begin(self, ranks: Sequence[tuple[int, torch.device]]) -> None: ...

    def mark(self, rank: int, device: torch.device) -> Any: ...

    def hand_over(self, values: Values, mark: Any, rank: int, device: torch.device) -> Values: ...

    def finish(self, ranks: Sequence[tuple[int, torch.device]]) -> None: ...


class NoStreams:
    """Nothing to order (CPU devices): hand-overs are plain copies."""

    def compute(self, rank: int, device: torch.device) -> AbstractContextManager[Any]:
        return nullcontext()

    def begin(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        return None

    def mark(self, rank: int, device: torch.device) -> Any:
        return None

    def hand_over(self, values: Values, mark: Any, rank: int, device: torch.device) -> Values:
        return tuple(None if v is None else v.to(device, non_blocking=True) for v in values)

    def finish(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        return None


class CudaStreams:
    """One compute and one copy stream per rank on its CUDA device, made on first use."""

    def __init__(self) -> None:
        self._compute: dict[int, torch.cuda.Stream] = {}
        self._copy: dict[int, torch.cuda.Stream] = {}

    def _streams(self, rank: int, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        return self.streams_of(rank, device)

    def streams_of(self, rank: int, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """A rank's (compute, copy) streams on its CUDA device, made once, on first use."""
        if rank not in self._compute:
            self._compute[rank] = torch.cuda.Stream(device)
            self._copy[rank] = torch.cuda.Stream(device)
        return self._compute[rank], self._copy[rank]

    def compute(self, rank: int, device: torch.device) -> AbstractContextManager[Any]:
        if device.type != "cuda":
            return nullcontext()
        return torch.cuda.stream(self._streams(rank, device)[0])

    def begin(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        for rank, device in ranks:
            if device.type == "cuda":
                self._streams(rank, device)[0].wait_stream(torch.cuda.current_stream(device))

    def mark(self, rank: int, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(self._streams(rank, device)[0])
        return event

    def hand_over(self, values: Values, mark: Any, rank: int, device: torch.device) -> Values:
        if device.type != "cuda":  # a CPU receiver of a GPU sender: wait for the sender's values
            if mark is not None:
                mark.synchronize()
            return tuple(None if v is None else v.to(device) for v in values)
        compute, copy = self._streams(rank, device)
        if mark is not None:
            copy.wait_event(mark)
        out = []
        with torch.cuda.stream(copy):
            for v in values:
                if v is None:
                    out.append(None)
                    continue
                moved = v.to(device, non_blocking=True)
                if v.is_cuda:
                    v.record_stream(copy)  # the source must outlive the copy
                moved.record_stream(compute)  # used by the receiver's compute stream
                out.append(moved)
        compute.wait_stream(copy)
        return tuple(out)

    def finish(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        for rank, device in ranks:
            if device.type == "cuda" and rank in self._compute:
                torch.cuda.current_stream(device).wait_stream(self._compute[rank])


def streams_for(devices: Sequence[torch.device]) -> Streams:
    """``CudaStreams`` when some stage is on a GPU, else ``NoStreams``."""
    return CudaStreams() if any(d.type == "cuda" for d in devices) else NoStreams()

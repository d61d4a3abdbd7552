"""Streams of the local transport: each rank computes on its own stream, hand-overs copy on another.

Without this, every stage on a GPU would run on its device's default stream,
so a hand-over copy would queue behind every forward already launched there
and stages sharing a GPU would serialize. As in torchgpipe:

- ``compute(rank)``: the stream a rank's worker thread makes current for all its work;
- ``mark(rank)``: after a rank produced values to send, an event on its compute stream,
  with the rank and device (a ``Mark``);
- ``hand_over(values, mark, rank, device)``: between two GPUs the copy runs on the
  SENDER's copy stream (a copy between devices runs on the source device's current
  stream), entered together with the receiver's copy stream, which receives the
  allocation and the completion; ``record_stream`` on the source for the sender's copy
  stream, on the copy for the receiver's compute stream, which waits for the copy. Each
  rank has one copy stream, for activations and gradients alike. On one GPU nothing is
  copied: the receiver's compute stream waits for the mark;
- ``begin`` / ``finish``: compute streams wait for the caller's stream (the optimizer
  updated the parameters there), and the caller's stream waits for them at the end.

``NoStreams`` is the CPU's (plain copies, nothing to order); ``CudaStreams`` the GPU's,
driving ``torch.cuda`` through ``TorchCuda`` (a test passes a recording stand-in).
A test can pass its own object with these methods to watch the plumbing.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, NamedTuple, Protocol, cast

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


class Mark(NamedTuple):
    """Values a rank produced: an event recorded on its compute stream, the rank, its device."""

    event: Any
    rank: int
    device: torch.device


class TorchCuda:
    """The few ``torch.cuda`` calls ``CudaStreams`` makes."""

    Stream = staticmethod(torch.cuda.Stream)
    Event = staticmethod(torch.cuda.Event)
    stream = staticmethod(torch.cuda.stream)
    current_stream = staticmethod(torch.cuda.current_stream)

    @staticmethod
    def move(tensor: Tensor, device: torch.device) -> Tensor:
        return tensor.to(device, non_blocking=True)

    @staticmethod
    def record(tensor: Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class CudaStreams:
    """One compute and one copy stream per rank on its CUDA device, made on first use."""

    def __init__(self, cuda: Any = TorchCuda) -> None:
        self.cuda = cuda
        self._compute: dict[int, Any] = {}
        self._copy: dict[int, Any] = {}

    def _streams(self, rank: int, device: torch.device) -> tuple[Any, Any]:
        return self.streams_of(rank, device)

    def streams_of(self, rank: int, device: torch.device) -> tuple[Any, Any]:
        """A rank's (compute, copy) streams on its CUDA device, made once, on first use."""
        if rank not in self._compute:
            self._compute[rank] = self.cuda.Stream(device)
            self._copy[rank] = self.cuda.Stream(device)
        return self._compute[rank], self._copy[rank]

    def compute(self, rank: int, device: torch.device) -> AbstractContextManager[Any]:
        if device.type != "cuda":
            return nullcontext()
        return cast("AbstractContextManager[Any]", self.cuda.stream(self._streams(rank, device)[0]))

    def begin(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        for rank, device in ranks:
            if device.type == "cuda":
                self._streams(rank, device)[0].wait_stream(self.cuda.current_stream(device))

    def mark(self, rank: int, device: torch.device) -> Mark | None:
        if device.type != "cuda":
            return None
        event = self.cuda.Event()
        event.record(self._streams(rank, device)[0])
        return Mark(event, rank, device)

    def hand_over(self, values: Values, mark: Any, rank: int, device: torch.device) -> Values:
        if device.type != "cuda":  # a CPU receiver of a GPU sender: wait for the sender's values
            if mark is not None:
                mark.event.synchronize()
            return tuple(None if v is None else v.to(device) for v in values)
        compute, copy = self._streams(rank, device)
        if mark is not None and mark.device == device:  # the same GPU: nothing to copy
            compute.wait_event(mark.event)
            for v in values:
                if v is not None:
                    self.cuda.record(v, compute)  # made on the sender's stream, read on this one
            return values
        if mark is None:  # from the host: the copy runs on the receiver's copy stream
            entered: list[Any] = [copy]
        else:  # from another GPU: on the sender's copy stream, with the receiver's entered too
            source = self._streams(mark.rank, mark.device)[1]
            source.wait_event(mark.event)
            entered = [source, copy]
        out: list[Tensor | None] = []
        with ExitStack() as stack:
            for stream in entered:
                stack.enter_context(self.cuda.stream(stream))
            for v in values:
                if v is None:
                    out.append(None)
                    continue
                moved = self.cuda.move(v, device)
                if mark is not None:
                    self.cuda.record(v, entered[0])  # the source is read on the sender's copy stream
                self.cuda.record(moved, compute)  # allocated on the receiver's copy stream, read on compute
                out.append(moved)
        compute.wait_stream(copy)  # the copy made the receiver's current (copy) stream wait for it
        return tuple(out)

    def finish(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        for rank, device in ranks:
            if device.type == "cuda" and rank in self._compute:
                self.cuda.current_stream(device).wait_stream(self._compute[rank])


def streams_for(devices: Sequence[torch.device]) -> Streams:
    """``CudaStreams`` when some stage is on a GPU, else ``NoStreams``."""
    return CudaStreams() if any(d.type == "cuda" for d in devices) else NoStreams()

"""The local transport's stream plumbing, driven through its device interface (a recording fake on CPU)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.devices.streams import CudaStreams, NoStreams, streams_for

needs_two_cuda = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


class Recording(NoStreams):
    """Plain CPU hand-overs, recording each call and which rank's thread made it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.inside: dict[int, int] = {}
        self.lock = threading.Lock()
        self.marks = 0

    @contextmanager
    def compute(self, rank: int, device: torch.device):  # noqa: ANN201 - a context manager
        with self.lock:
            self.inside[threading.get_ident()] = rank
        yield

    def begin(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        self.calls.append(("begin", tuple(r for r, _ in ranks)))

    def mark(self, rank: int, device: torch.device) -> Any:
        with self.lock:
            self.marks += 1
            mark = ("mark", rank, self.marks)
            self.calls.append(mark + (self.inside.get(threading.get_ident()),))
        return mark

    def hand_over(self, values: Any, mark: Any, rank: int, device: torch.device) -> Any:
        with self.lock:
            self.calls.append(("hand_over", mark, rank, self.inside.get(threading.get_ident())))
        return super().hand_over(values, mark, rank, device)

    def finish(self, ranks: Sequence[tuple[int, torch.device]]) -> None:
        self.calls.append(("finish", tuple(r for r, _ in ranks)))


def test_every_hand_over_waits_for_the_sender_s_mark_inside_the_ranks_streams() -> None:
    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)),
                 partitions=3, chunks=4)
    pipe.channel.streams = fake = Recording()
    pipe.train_step(torch.randn(8, 4), torch.randn(8, 2), nn.functional.mse_loss)
    assert fake.calls[0] == ("begin", (0, 1, 2)) and fake.calls[-1] == ("finish", (0, 1, 2))
    marks = [c for c in fake.calls if c[0] == "mark"]
    overs = [c for c in fake.calls if c[0] == "hand_over"]
    # 2 boundaries x 4 micro-batches, forward and backward
    assert len(marks) == len(overs) == 16
    assert all(m[1] == m[3] for m in marks), "a mark is made inside its own rank's compute stream"
    assert all(h[2] == h[3] for h in overs), "a hand-over runs inside the receiver's compute stream"
    made = {m[:3] for m in marks}
    assert all(h[1] in made and abs(h[1][1] - h[2]) == 1 for h in overs), "each waits for a neighbour's mark"
    assert fake.calls.index(overs[0]) > fake.calls.index(next(m for m in marks if m[:3] == overs[0][1]))


def test_cpu_stages_use_no_streams() -> None:
    assert isinstance(streams_for([torch.device("cpu")] * 2), NoStreams)
    assert isinstance(streams_for([torch.device("cpu"), torch.device("cuda", 0)]), CudaStreams)


@needs_two_cuda
def test_two_gpus_equal_unpipelined_with_streams() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    ref = nn.Sequential(*[m for m in __import__("copy").deepcopy(model)]).cuda(0)
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    nn.functional.mse_loss(ref(x.cuda(0)), y.cuda(0)).backward()
    pipe = GPipe(model, partitions=2, chunks=4, devices=["cuda:0", "cuda:1"])
    assert isinstance(pipe.channel.streams, CudaStreams)
    for _ in range(2):  # the second step reuses the streams
        model.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss)
        for a, b in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(a.grad, b.grad.to(a.device), rtol=1e-5, atol=1e-5)


class FakeStream:
    def __init__(self, device: torch.device, log: list) -> None:
        self.device, self.log = device, log

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait_event", self, event))

    def wait_stream(self, other: Any) -> None:
        self.log.append(("wait_stream", self, other))


class FakeCuda:
    """``TorchCuda`` on the CPU: streams and events are tokens, every call is logged."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.made: list[FakeStream] = []
        self.entered: list[FakeStream] = []

    def Stream(self, device: torch.device) -> FakeStream:  # noqa: N802 - torch.cuda's name
        self.made.append(FakeStream(device, self.log))
        return self.made[-1]

    def Event(self) -> Any:  # noqa: N802
        log = self.log

        class _Event:
            def record(self, stream: FakeStream) -> None:
                log.append(("record_event", self, stream))

        return _Event()

    @contextmanager
    def stream(self, s: FakeStream):  # noqa: ANN201 - a context manager
        self.entered.append(s)
        try:
            yield
        finally:
            self.entered.pop()

    def current_stream(self, device: torch.device) -> str:
        return f"current:{device}"

    def move(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.log.append(("copy", tuple(self.entered)))
        return tensor.clone()

    def record(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", id(tensor), stream))


def test_a_copy_between_gpus_runs_on_the_sender_s_copy_stream_with_both_entered() -> None:
    cuda = FakeCuda()
    streams = CudaStreams(cuda)
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    src_compute, src_copy = streams.streams_of(0, gpu0)
    dst_compute, dst_copy = streams.streams_of(1, gpu1)
    value = torch.ones(3)
    mark = streams.mark(0, gpu0)
    cuda.log.clear()
    (moved,) = streams.hand_over((value,), mark, 1, gpu1)
    assert cuda.log[0] == ("wait_event", src_copy, mark.event), "the sender's copy stream waits for its compute"
    assert cuda.log[1] == ("copy", (src_copy, dst_copy)), "entered on both devices, source first"
    assert ("record_stream", id(value), src_copy) in cuda.log, "the source is recorded on its own device"
    assert ("record_stream", id(moved), dst_compute) in cuda.log, "the copy is recorded for the receiver"
    assert cuda.log[-1] == ("wait_stream", dst_compute, dst_copy)
    streams.hand_over((moved,), streams.mark(1, gpu1), 0, gpu0)  # the gradient, the other way
    assert len(cuda.made) == 4, "one compute and one copy stream per rank, for both directions"
    assert ("copy", (dst_copy, src_copy)) in cuda.log


def test_a_hand_over_on_one_gpu_copies_nothing_and_orders_the_receiver() -> None:
    cuda = FakeCuda()
    streams = CudaStreams(cuda)
    gpu = torch.device("cuda", 0)
    value = torch.ones(2)
    mark = streams.mark(0, gpu)
    cuda.log.clear()
    (out,) = streams.hand_over((value,), mark, 1, gpu)
    compute = streams.streams_of(1, gpu)[0]
    assert out is value and not any(e[0] == "copy" for e in cuda.log)
    assert cuda.log == [("wait_event", compute, mark.event), ("record_stream", id(value), compute)]


def test_a_hand_over_from_the_host_copies_on_the_receiver_s_copy_stream() -> None:
    cuda = FakeCuda()
    streams = CudaStreams(cuda)
    gpu = torch.device("cuda", 0)
    streams.hand_over((torch.ones(2),), streams.mark(0, torch.device("cpu")), 1, gpu)
    compute, copy = streams.streams_of(1, gpu)
    assert ("copy", (copy,)) in cuda.log and cuda.log[-1] == ("wait_stream", compute, copy)

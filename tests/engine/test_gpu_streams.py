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
from gpipe_lab.pipeline.streams import CudaStreams, NoStreams, streams_for

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

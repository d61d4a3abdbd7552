"""The one executor on the distributed transport (gloo, K=2 x D=2), in one launch.

In order, on every rank: a step longer than the timeout whose waits are each shorter
finishes; ``pipe.timeout = x`` reaches the data-parallel gradient all-reduce; a wait
longer than the timeout raises ``PipelineTimeoutError`` (``PeerTimeoutError``, naming
the peer). The local transport's counterparts: tests/engine/test_executor.py.
(``pipe(x).backward()`` does not exist across processes: ``DistributedGPipe`` refuses
it, see test_distributed.py; its ``train_step`` non-finite policy is tested there.)
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline.distributed.spawn import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]
GAVE_UP = "test/stage-1-gave-up"


class Probe(nn.Module):
    """Identity that takes ``delay`` seconds per forward; ``stall`` (if set) runs once instead."""

    def __init__(self) -> None:
        super().__init__()
        self.delay, self.calls, self.stall = 0.0, 0, None
        self._never = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.stall is not None:
            stall, self.stall = self.stall, None
            stall()
        self._never.wait(self.delay)  # a stand-in for a slow layer
        return x


def worker(rank: int, world: int) -> dict:
    from gpipe_lab.pipeline import PipelineTimeoutError
    from gpipe_lab.pipeline.distributed import DistributedGPipe, grad_sync

    waits: list[float] = []
    real_wait = grad_sync.wait_works

    def recording_wait(works, what, peer, timeout, abort):
        waits.append(timeout)
        return real_wait(works, what, peer, timeout, abort)

    grad_sync.wait_works = recording_wait
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    probe = Probe()
    pipe = DistributedGPipe(nn.Sequential(nn.Linear(4, 4), probe, nn.Linear(4, 4)), balance=[2, 1], chunks=8,
                            checkpoint="never", timeout=300.0, seed=0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.train_step(x, y, F.mse_loss)  # a process's first step pays one-off set-up costs
    out: dict = {}
    # 1. K=2, M=8, timeout=2: stage 0 takes 0.4 s per micro-batch, the step more than 3.2 s
    probe.delay, probe.calls = 0.4, 0
    pipe.timeout = 2.0
    out["loss"] = pipe.train_step(x, y, F.mse_loss).item()
    out["slow_forwards"] = probe.calls
    # 2. the gradient all-reduce of that step waited with the new timeout
    out["grad_sync_timeouts"] = list(waits)
    # 3. replica 0's stage 0 holds its first forward until its stage 1 gave up (bounded)
    probe.delay = 0.0
    pipe.timeout = 1.5
    if rank == 0:
        probe.stall = lambda: store.wait([GAVE_UP], timedelta(seconds=30))
    try:
        pipe.train_step(x, y, F.mse_loss)
        out["error"] = None
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out["error"] = (type(exc).__name__, isinstance(exc, PipelineTimeoutError), str(exc))
    finally:
        if rank == 1:
            store.set(GAVE_UP, "1")
    return out


def test_timeout_is_per_wait_reaches_grad_sync_and_raises_on_a_long_wait() -> None:
    results = run_local(worker, 4, timeout=150)
    for r in results:
        assert r.exitcode == 0 and r.value is not None, r.error
    for r in results:
        assert torch.isfinite(torch.tensor(r.value["loss"])), r.value
        assert r.value["grad_sync_timeouts"] == [300.0, 2.0], r.value  # constructor's, then pipe.timeout
        assert r.value["error"] is not None, f"rank {r.rank} finished a step whose stage 0 stalled"
    for r in results[0::2]:  # stage 0 of each replica ran all 8 slow forwards
        assert r.value["slow_forwards"] == 8, r.value
    name, is_timeout, message = results[1].value["error"]
    assert name == "PeerTimeoutError" and is_timeout, message
    assert "rank 1 waited more than 1.5 s for the activation of micro-batch 0 from rank 0" in message

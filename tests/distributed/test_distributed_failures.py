"""A failing, killed or hung rank stops every rank within the timeout, naming the culprit."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]
# generous: a loaded machine must not turn a slow start into a timeout; raising and killed
# ranks are named through the abort key and the peers' processes, long before it
TIMEOUT = 30.0
# the hung rank stays stuck until every peer has ended its step, then leaves with this code:
# proof that the peers stopped on their own while it was still hung
RELEASED = 7
ENDED, RELEASE = "test/peers-ended", "test/release-the-hung-rank"


def shared_store() -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=60))


class Trap(nn.Module):
    """Identity, except on forward call ``when`` (2 = micro-batch 2 of the first step)."""

    def __init__(self, mode: str, when: int = 2) -> None:
        super().__init__()
        self.mode, self.when, self.calls = mode, when, 0
        self.store = shared_store() if mode == "hang" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls == self.when:
            if self.mode == "raise":
                raise ValueError("boom")
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "hang":  # hangs: the engine is never told; only the peers' ends release it
                self.store.wait([RELEASE], timedelta(seconds=60))
                os._exit(RELEASED)
        self.calls += 1
        return x


def failing_worker(rank: int, world: int, mode: str, trap_stage: int, timeout: float = TIMEOUT,
                   clean_steps: int = 0) -> None:
    """Run ``clean_steps`` good steps, then one whose micro-batch 2 trips the trap on ``trap_stage``."""
    chunks = 4
    layers = [nn.Linear(4, 4) for _ in range(world)]
    layers.insert(trap_stage + 1, Trap(mode, when=clean_steps * chunks + 2))
    pipe = DistributedGPipe(nn.Sequential(*layers), balance=[1] * trap_stage + [2] + [1] * (world - trap_stage - 1),
                            chunks=chunks, checkpoint="never", timeout=timeout, seed=0)
    try:
        for _ in range(clean_steps + 1):
            pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss)
    finally:
        if mode == "hang" and shared_store().add(ENDED, 1) == world - 1:
            shared_store().set(RELEASE, "1")


def test_raising_rank_stops_every_rank() -> None:
    results = run_local(failing_worker, 3, args=("raise", 2), timeout=60)
    for r in results:
        assert r.exitcode == 1 and r.ended is not None
        assert "rank 2" in r.error, r.error
    assert results[2].error_type == "ValueError"
    assert "boom" in results[2].error and "micro-batch 2" in results[2].error
    assert all("micro-batch 2" in r.error and "boom" in r.error for r in results)


def test_killed_rank_makes_others_fail_naming_it() -> None:
    results = run_local(failing_worker, 3, args=("kill", 1), timeout=60)
    assert results[1].exitcode == -signal.SIGKILL
    for r in (results[0], results[2]):
        assert r.exitcode == 1, r.error
        assert "rank 1" in r.error, r.error
        assert r.ended is not None


@pytest.mark.slow
def test_hung_rank_times_out_naming_it() -> None:
    # the step that hangs comes after a clean one, and the timeout is shorter than TIMEOUT but not
    # short: a rank descheduled for seconds on a loaded machine must not be taken for the hung one
    results = run_local(failing_worker, 3, args=("hang", 1, 15.0, 1), timeout=80)
    assert results[1].exitcode == RELEASED and results[1].error is None  # still hung when both peers ended
    for r in (results[0], results[2]):
        assert r.exitcode == 1, r.error
        assert "rank 1" in r.error and "alive" in r.error, r.error
        assert r.ended is not None

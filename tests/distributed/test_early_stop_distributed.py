"""A rank's failure stops its neighbour at the neighbour's next action (torchgpipe's early stop,
across processes), and nothing waits on a process group after a failed step: the pipe's next step
and a new pipe are refused at once, naming the earlier failure and the remedy.

One launch of 2 gloo ranks, schedule ``gpipe``, M = 8: rank 1 raises in its forward of micro-batch 0
while rank 0 runs its eight forwards, which need nothing from rank 1. Rank 0's second forward
waits (bounded) for the abort key, and rank 1 raises only once rank 0 is in it; rank 1's clean-up after the failing action is held until rank 0
has ended its step or run all its forwards. So rank 0 can stop after 2 forwards only if rank 1
announced from the failing stage thread, and rank 0 looked before each action (its store read made
unthrottled, ``poll_seconds = 0``, so the outcome does not depend on timing); announced only at the
end of rank 1's step, rank 0 runs all 8.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline.distributed import DistributedGPipe, GroupUnusableError
from gpipe_lab.pipeline.distributed.failure import ABORT_KEY
from gpipe_lab.pipeline.distributed.spawn import run_local
from gpipe_lab.pipeline.step.executor import Executor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

M = 8
TIMEOUT = 30.0  # per wait; a refusal must come at once, long before it
GATE_S = 20.0  # rank 0's bounded wait for the abort key (reached only when the announcement is late)
GATE = "test/rank-0-in-its-second-forward"
RANK0_DONE = "test/rank-0-done"  # rank 0 ended its step or ran all its forwards: rank 1's clean-up goes on
FORWARDS: list[int] = [0]  # rank 0's forward calls (the process's own counter)


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


class Gate(nn.Module):
    """Identity on rank 0 counting its forwards; the second waits until the abort key exists (or
    ``GATE_S``: then the step goes on as if nothing were announced)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARDS[0] += 1
        if FORWARDS[0] == 2:
            _store().set(GATE, "1")
            try:
                _store().wait([ABORT_KEY], timedelta(seconds=GATE_S))
            except RuntimeError:  # the store's wait timed out: the key came late
                pass
        if FORWARDS[0] == M:
            _store().add(RANK0_DONE, 1)
        return x


class Boom(nn.Module):
    """Raises in its first forward (rank 1's forward of micro-batch 0), once rank 0 is in its second."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _store().wait([GATE], timedelta(seconds=60))
        raise ValueError("boom")


def _pipe() -> DistributedGPipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Gate(), Boom(), nn.Linear(4, 4))
    return DistributedGPipe(model, balance=[2, 2], chunks=M, schedule="gpipe", checkpoint="never",
                            timeout=TIMEOUT, seed=0)


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def worker(rank: int, world: int) -> dict[str, Any]:
    pipe = _pipe()
    if rank == 0:
        pipe.abort.poll_seconds = 0.0
    else:  # the end of rank 1's step (its clean-up, then ``fail``) waits until rank 0 has shown how far it ran
        release = Executor._abort

        def held(self: Executor, ranks: Any) -> None:
            _store().wait([RANK0_DONE], timedelta(seconds=60))
            release(self, ranks)

        Executor._abort = held  # this worker process only
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    out = {"step": _outcome(lambda: pipe.train_step(x, y, F.mse_loss)), "forwards": FORWARDS[0]}
    if rank == 0:
        _store().add(RANK0_DONE, 1)
    out["abort"] = _store().get(ABORT_KEY).decode()
    out["step again"] = _outcome(lambda: pipe.train_step(x, y, F.mse_loss))
    out["forward again"] = _outcome(lambda: pipe(x))
    out["new pipe"] = _outcome(_pipe)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    results = run_local(worker, 2, timeout=120)
    assert [r.exitcode for r in results] == [0, 0], [r.error for r in results]
    return [r.value for r in results]


FAILED = "rank 1 failed in stage 1, forward of micro-batch 0: ValueError: rank 1: boom [in stage 1, forward of micro-batch 0]"


def test_neighbour_stops_at_its_next_action_once_a_rank_raises(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    assert rank0["forwards"] == 2, rank0  # 8 when rank 1 announces only at its step's end
    assert rank0["step"].startswith(f"PeerFailedError: rank 0 stopped because {FAILED}"), rank0["step"]
    assert rank0["step"].endswith("[in stage 0, forward of micro-batch 2]"), rank0["step"]
    # the texts as before: annotated and announced once
    assert rank1["step"] == "ValueError: rank 1: boom [in stage 1, forward of micro-batch 0]", rank1["step"]
    assert rank0["abort"] == rank1["abort"] == FAILED


def test_after_a_failed_step_the_next_step_and_a_new_pipe_are_refused_at_once(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        for what, refused in (("step again", "train_step() / pipe(x)"), ("forward again", "train_step() / pipe(x)"),
                              ("new pipe", "DistributedGPipe()")):
            text = rank[what]
            assert text.startswith(f"GroupUnusableError: {refused} refused: a step failed earlier on this "
                                   f"process group ({FAILED})"), (what, text)
            assert "restart the processes" in text, (what, text)
    error = GroupUnusableError("DistributedGPipe()", FAILED)
    assert error.failed_ranks == (1,) and error.failure == FAILED

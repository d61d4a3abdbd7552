"""The non-finite check of a stage runs on its own worker as soon as its gradients are final
(``step/stage_flags.py``), overlapping earlier stages' backward; the verdict is unchanged: with data
parallelism a stage is judged after its gradients' all-reduce."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import NonFiniteError
from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local

WAIT = 10.0  # bounds a wait that the fixed engine ends at once


class HoldLastBackward(nn.Module):
    """Identity whose backward of the ``calls``-th micro-batch waits (bounded) for ``released``,
    recording whether it came before the wait ran out."""

    def __init__(self, calls: int, released: threading.Event) -> None:
        super().__init__()
        self.calls, self.released, self.seen = calls, released, 0
        self.came: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        y.register_hook(self._backward)
        return y

    def _backward(self, grad: torch.Tensor) -> None:
        self.seen += 1
        if self.seen == self.calls:
            self.came.append(self.released.wait(WAIT))


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_the_last_stage_is_checked_while_the_first_still_back_propagates(schedule, monkeypatch) -> None:
    chunks = 2
    checked = threading.Event()
    hold = HoldLastBackward(chunks, checked)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), hold, nn.Linear(4, 4))
    pipe = GPipe(model, balance=[2, 1], chunks=chunks, checkpoint="never", schedule=schedule)
    last = model[2].weight
    threads: list[str] = []
    aminmax = torch.aminmax  # the CPU's read-only check reads each gradient with it

    def watched(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        if last.grad is not None and t.data_ptr() == last.grad.data_ptr():
            threads.append(threading.current_thread().name)
            checked.set()
        return aminmax(t, *args, **kwargs)

    monkeypatch.setattr(torch, "aminmax", watched)
    loss = pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    assert torch.isfinite(loss) and not pipe.last_step_skipped
    assert hold.came == [True], "stage 1's gradients were checked only after stage 0's last backward"
    assert threads == ["gpipe-stage-1"]  # once, by stage 1's own worker


def test_a_callers_graph_reaching_a_stage_parameter_is_judged_after_it(monkeypatch) -> None:
    """A front end of the caller's that uses a stage's parameter (tied weights) adds to its
    gradient after the pipeline's backward: the verdict still sees that gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = GPipe(model, balance=[1, 1], chunks=2, checkpoint="never")
    tied = model[1].bias.clone()
    tied.register_hook(lambda g: g * float("nan"))  # only the caller's path turns NaN
    with pytest.raises(NonFiniteError, match="gradients of stage 1 are not finite"):
        pipe.train_step(torch.randn(4, 4) + tied, torch.randn(4, 4), F.mse_loss)


def large(p: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.fill_(60000.0)  # finite in float16; the sum of two replicas' is not


def replica_sum_worker(rank: int, world: int) -> str:
    """K=2 × D=2 in float16: each replica's gradient of stage 0's bias is finite, their sum is inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    pipe = DistributedGPipe(model, balance=[1, 1], chunks=2, checkpoint="never", timeout=30.0, seed=0,
                            data_parallel_size=2)
    first = pipe.stage_index == 0
    if first:
        model[0].bias.register_post_accumulate_grad_hook(large)
    x, y = torch.randn(4, 4).half(), torch.randn(4, 4).half()
    try:
        pipe.train_step(x if first else None, y, F.mse_loss)
    except NonFiniteError as exc:
        return str(exc)
    return "finite"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_replicated_stage_is_judged_after_its_all_reduce() -> None:
    results = run_local(replica_sum_worker, 4, timeout=100)
    assert [r.value for r in results] == ["step 0: gradients of stage 0 are not finite "
                                          "(set nonfinite='skip' to skip such steps)"] * 4, results

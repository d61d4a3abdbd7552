"""The one executor on the local transport: per-wait timeout, the non-finite policy of
``pipe(x).backward()``, and stage backward on the stage's own thread.

The same drifts on the distributed transport: tests/distributed/test_executor_distributed.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import NonFiniteError, PipelineTimeoutError
from helpers.threads import busy_stage_threads, wait_for_stage_threads

pytestmark = pytest.mark.timeout(60)


class Slow(nn.Module):
    """Identity that takes ``seconds`` per forward (a stand-in for a slow layer)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.calls = seconds, 0
        self._clock = threading.Event()  # never set: wait() is a bounded delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # forwards only, not the replays
            self.calls += 1
        self._clock.wait(self.seconds)
        return x


stage_threads = busy_stage_threads


def test_a_step_longer_than_the_timeout_finishes_when_every_wait_is_shorter() -> None:
    """K=2, M=8, timeout=2: stage 0 takes 0.4 s per micro-batch, so stage 1 waits ~0.4 s each
    time while the step lasts more than 3.2 s; ``timeout`` bounds each wait, not the step."""
    torch.manual_seed(0)
    slow = Slow(0.4)
    model = nn.Sequential(nn.Linear(4, 4), slow, nn.Linear(4, 4))
    pipe = GPipe(model, balance=[2, 1], chunks=8, checkpoint="never")
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.train_step(x, y, F.mse_loss)  # a process's first step pays one-off set-up costs
    model.zero_grad()
    slow.calls = 0
    pipe.timeout = 2.0
    loss = pipe.train_step(x, y, F.mse_loss)
    assert slow.calls == 8  # the step ran all 8 slow forwards: longer than the timeout
    model.zero_grad()
    expected = F.mse_loss(model(x), y)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


class Stall(nn.Module):
    """Holds its stage once, until the other stage threads have given up waiting for it (bounded)."""

    armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            wait_for_stage_threads()
        return x


def test_a_wait_longer_than_the_timeout_raises_and_a_new_timeout_reaches_the_waits() -> None:
    torch.manual_seed(0)
    stall = Stall()
    stall.armed = False
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), stall, nn.Linear(4, 4)), balance=[1, 2], chunks=4,
                 timeout=300.0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.train_step(x, y, F.mse_loss)  # one-off set-up costs are paid under the long timeout
    stall.armed = True
    # Set between steps: the executor's waits read it. Long enough that no wait but the stalled
    # one can reach it on a loaded machine, short enough to keep the test quick.
    pipe.timeout = 1.5
    with pytest.raises(PipelineTimeoutError, match="timeout of 1.5 s") as info:
        pipe.train_step(x, y, F.mse_loss)
    assert "stage 0: last completed F3@0, waiting on B3@0" in str(info.value)  # waited for stage 1
    assert not stage_threads()
    pipe.timeout = 30.0
    assert torch.isfinite(pipe.train_step(x, y, F.mse_loss))


class NaNAfter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan")


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nan_through_pipe_x_backward_follows_the_nonfinite_policy(policy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NaNAfter(), nn.Linear(4, 4))
    pipe = GPipe(model, balance=[2, 1], chunks=2, nonfinite=policy)
    out = pipe(torch.randn(4, 4))
    if policy == "raise":
        with pytest.raises(NonFiniteError, match="step 0: gradients of stage 0 are not finite"):
            out.sum().backward()
    else:
        out.sum().backward()
        assert pipe.last_step_skipped and pipe.skipped_steps == 1
        assert all(p.grad is None for p in model.parameters())


def test_a_stage_back_propagates_on_its_own_thread_with_autograd_multithreading_off() -> None:
    """In ``pipe(x).backward()`` the caller's thread runs the output's backward node and waits
    for the stages; each stage's backward must run on the stage's thread (on CUDA, the
    engine's device worker would otherwise run it: the thread that is waiting)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    pipe = GPipe(model, balance=[2, 2], chunks=2)
    seen: dict[int, set] = {0: set(), 2: set()}

    def hook(index: int):
        def record(module, grad_input, grad_output):
            seen[index].add((threading.current_thread().name, torch._C._is_multithreading_enabled()))
        return record

    for index in seen:
        model[index].register_full_backward_hook(hook(index))
    out = pipe(torch.randn(4, 4, requires_grad=True))
    out.sum().backward()
    assert seen[0] == {("gpipe-stage-0", False)}
    assert seen[2] == {("gpipe-stage-1", False)}
    assert torch._C._is_multithreading_enabled()  # the caller's own setting is untouched


class Hold(nn.Module):
    """Holds its stage on the first forward until ``release`` (bounded)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.release.wait(30)
        return x


@pytest.mark.parametrize("balance,message", [
    ([2], "no stage progressed longer than the timeout of 0.3 s"),  # no neighbour to time out
    ([1, 1], "stage 0: last completed F1@0, waiting on B1@0"),  # the neighbour's error is reported
])
def test_the_callers_wait_is_bounded_when_a_stage_is_stuck_in_a_computation(balance, message) -> None:
    """A stage stuck in one computation (as a backward that can never be scheduled would be)
    reaches the caller as an error within a bounded time, though its thread cannot be stopped."""
    hold = Hold()
    # one thread per stage: a single stage of several threads runs on the caller's thread (below)
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), hold), balance=balance, chunks=2, timeout=300.0,
                 threads_per_stage=1)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.timeout = 0.3
    try:
        with pytest.raises(PipelineTimeoutError, match=message):
            pipe.train_step(x, y, F.mse_loss)
    finally:
        hold.release.set()
    wait_for_stage_threads()
    assert not stage_threads()
    pipe.timeout = 30.0
    assert torch.isfinite(pipe.train_step(x, y, F.mse_loss))


class WhereRun(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.threads: list[tuple[str, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.append((threading.current_thread().name, torch.get_num_threads()))
        return x


@pytest.mark.parametrize("balance,threads,on_caller", [([2], 2, True), ([2], 1, False), ([1, 1], 2, False)])
def test_a_single_cpu_stage_of_several_threads_runs_on_the_callers_thread(balance, threads, on_caller) -> None:
    """libgomp's teams: a multi-threaded stage beside the caller's own team slows every small
    parallel region, so one local CPU stage of several threads runs where the caller runs."""
    where = WhereRun()
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), where), balance=balance, chunks=2, threads_per_stage=threads)
    before = torch.get_num_threads()
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    names = {name for name, _ in where.threads}
    assert (names == {threading.current_thread().name}) is on_caller
    assert {n for _, n in where.threads} == {threads} and torch.get_num_threads() == before


class _Drawing(nn.Module):
    """BatchNorm, a functional random draw and dropout: what a replay must reproduce."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x))) + 0.1 * torch.rand_like(x)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_single_stage_on_the_callers_thread_computes_what_its_worker_computes(checkpoint: str) -> None:
    """The same losses, gradients, buffers and outputs (under no_grad and under autocast), the
    same random draws included, on the caller's thread (two intra-op threads) as on a worker (one):
    the path changes where the stage runs, not what it computes. Only the reduction order of two
    threads against one differs: plain PyTorch on this model differs by up to 9e-5 between one and
    two threads (BatchNorm's backward), a draw replayed wrongly by O(0.1)."""
    runs = []
    for threads in (2, 1):
        torch.manual_seed(0)
        model = nn.Sequential(_Drawing(), nn.Linear(4, 4))
        pipe = GPipe(model, balance=[2], chunks=3, checkpoint=checkpoint, devices=["cpu"], seed=5,
                     threads_per_stage=threads)
        x, y = torch.randn(9, 4, generator=torch.Generator().manual_seed(1)), torch.randn(9, 4)
        losses = [pipe.train_step(x, y, F.mse_loss) for _ in range(2)]
        with torch.no_grad():
            sampled = pipe(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = pipe(x)
        runs.append((losses, [p.grad for p in model.parameters()], list(model.buffers()), sampled, cast))
    for a, b in zip(*runs):
        for u, v in zip(a, b):
            tol = {} if u.dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 2e-4}
            torch.testing.assert_close(u, v, **tol)

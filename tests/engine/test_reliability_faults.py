"""Faults in the local transport: every stage x {forward, backward, recompute} x schedule.

A layer that raises stops the step with the ORIGINAL exception type, the message
names the stage and the micro-batch, every worker thread has ended, nothing of the
failed step survives (saved activations, deferred BatchNorm sums), and the very
same ``GPipe`` object trains correctly on the next step.

(Construction errors and the one-stage smoke test live in test_pipeline_errors.py;
the distributed transport's faults in test_reliability_distributed.py.)
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import DeferredBatchNorm, PipelineTimeoutError
from gpipe_lab.pipeline.stage.context import is_recomputing
from helpers.faults import CHUNKS, NUM_STAGES, SEED, Fault, InjectedFault
from helpers.threads import busy_stage_threads, wait_for_stage_threads


def build(fault: Fault, fault_stage: int, batch_norm: bool = False) -> nn.Sequential:
    """Three stages of [Linear, (BatchNorm), Tanh, Fault-or-Identity]."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(NUM_STAGES):
        layers += [nn.Linear(6, 6), nn.BatchNorm1d(6) if batch_norm else nn.Identity(), nn.Tanh(),
                   fault if k == fault_stage else nn.Identity()]
    return nn.Sequential(*layers)


def reference_loss_and_grads(x, y):
    torch.manual_seed(0)
    plain = build(Fault("forward", 0, 0), 0)
    plain[3].armed = False
    loss = F.mse_loss(plain(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in plain.parameters()]


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


gpipe_threads = busy_stage_threads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("when", ["forward", "backward", "recompute"])
@pytest.mark.parametrize("stage", range(NUM_STAGES))
def test_fault_in_any_stage_and_phase_stops_the_step_and_the_pipe_is_reusable(stage, when, schedule):
    microbatch = 2
    fault = Fault(when, stage, microbatch)
    model = build(fault, stage)
    checkpoint = "always" if when == "recompute" else "never"
    pipe = GPipe(model, balance=[4] * NUM_STAGES, chunks=CHUNKS, checkpoint=checkpoint, schedule=schedule,
                 seed=SEED, timeout=300)
    x, y = data()
    assert not gpipe_threads()
    # a stage waiting out its 300 s timeout instead of stopping would trip the 60 s mark
    with pytest.raises(InjectedFault, match=f"injected fault in {when}") as info:
        pipe.train_step(x, y, F.mse_loss)
    phase = "forward" if when == "forward" else "backward"  # recompute runs inside the backward action
    assert f"[in stage {stage}, {phase} of micro-batch {microbatch}]" in str(info.value)
    assert info.value.gpipe_stage == stage and info.value.gpipe_microbatch == microbatch
    assert not gpipe_threads(), "a worker thread still runs the failed step"
    assert all(not s._saved and s.live_bytes == 0 for s in pipe.stages), "saved activations leaked"

    # the same object works on the next step, with exactly the unpipelined loss and gradients
    fault.armed = False
    model.zero_grad(set_to_none=True)
    loss = pipe.train_step(x, y, F.mse_loss)
    ref_loss, ref_grads = reference_loss_and_grads(x, y)
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for got, want in zip((p.grad for p in model.parameters()), ref_grads):
        assert torch.allclose(got, want, atol=1e-6)
    assert not gpipe_threads()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["forward", "backward", "recompute"])
def test_failed_step_does_not_commit_deferred_batch_norm_statistics(when):
    fault = Fault(when, 1, 1)
    model = build(fault, 1, batch_norm=True)
    pipe = GPipe(model, balance=[4] * NUM_STAGES, chunks=CHUNKS, seed=SEED, deferred_batch_norm=True,
                 checkpoint="always" if when == "recompute" else "never")
    bns = [m for m in model.modules() if isinstance(m, DeferredBatchNorm)]
    before = [(b.running_mean.clone(), b.running_var.clone(), int(b.num_batches_tracked)) for b in bns]
    x, y = data()
    with pytest.raises(InjectedFault):
        pipe.train_step(x, y, F.mse_loss)
    for b, (mean, var, n) in zip(bns, before):
        assert torch.equal(b.running_mean, mean) and torch.equal(b.running_var, var)
        assert int(b.num_batches_tracked) == n and int(b.count) == 0, "partial sums of the failed step kept"
    # the next step commits exactly one mini-batch: the first BN's stats equal a full-batch BN's
    fault.armed = False
    pipe.train_step(x, y, F.mse_loss)
    torch.manual_seed(0)
    plain_bn = nn.BatchNorm1d(6)
    plain_bn(model[0](x))
    assert int(bns[0].num_batches_tracked) == 1
    assert torch.allclose(bns[0].running_mean, plain_bn.running_mean, atol=1e-6)
    assert torch.allclose(bns[0].running_var, plain_bn.running_var, atol=1e-6)


@pytest.mark.timeout(60)
def test_fault_on_a_later_step_names_that_step_microbatch_and_keeps_earlier_progress():
    """A fault at step 3 leaves the parameters as the three good optimizer steps made them."""
    fault = Fault("backward", 2, 3, step=3)
    model = build(fault, 2)
    pipe = GPipe(model, balance=[4] * NUM_STAGES, chunks=CHUNKS, seed=SEED, schedule="1f1b")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    for _ in range(3):
        opt.zero_grad()
        pipe.train_step(x, y, F.mse_loss)
        opt.step()
    snapshot = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with pytest.raises(InjectedFault, match=r"stage 2, backward of micro-batch 3"):
        pipe.train_step(x, y, F.mse_loss)
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), snapshot))


def wait_for_other_stages(limit: float = 30.0) -> None:
    """Block until every other stage thread is idle (they time out waiting for this one)."""
    wait_for_stage_threads(limit)


class Stall(nn.Module):
    """Stalls its stage once: it returns only when the neighbours have given up on it."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x):
        if self.armed and not is_recomputing():
            self.armed = False
            wait_for_other_stages()
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stalled_stage_times_out_with_every_stage_state(schedule):
    stall = Stall()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), stall, nn.Linear(6, 6))
    pipe = GPipe(model, balance=[2, 1, 1], chunks=CHUNKS, schedule=schedule, timeout=30.0, seed=SEED)
    x, y = data()
    # armed after a first step: the first step's random-replay probe runs forwards one at a time,
    # so a neighbour would wait on the stalled forward's turn rather than time out on its input
    stall.armed = False
    pipe.train_step(x, y, F.mse_loss)
    stall.armed, pipe.timeout = True, 0.3
    with pytest.raises(PipelineTimeoutError, match="longer than the timeout of 0.3 s") as info:
        pipe.train_step(x, y, F.mse_loss)
    message = str(info.value)
    for k in range(3):
        assert f"stage {k}: last completed" in message
    assert "waiting on" in message
    wait_for_stage_threads()  # the stalled stage's compute cannot be interrupted: it ends by itself
    assert not gpipe_threads()
    model.zero_grad()
    pipe.timeout = 30.0  # the stall is disarmed; 0.3 s is too tight for a normal step on a loaded machine
    assert torch.isfinite(pipe.train_step(x, y, F.mse_loss))


@pytest.mark.timeout(60)
def test_keyboard_interrupt_in_a_stage_reaches_the_caller_as_keyboard_interrupt():
    """Ctrl-C raised inside a worker (e.g. by a signal-aware layer) is not swallowed or retyped."""

    class Interrupt(nn.Module):
        armed = True

        def forward(self, x):
            if self.armed:
                raise KeyboardInterrupt
            return x

    layer = Interrupt()
    pipe = GPipe(nn.Sequential(nn.Linear(6, 6), layer, nn.Linear(6, 6)), balance=[1, 1, 1], chunks=2)
    x, y = data()
    with pytest.raises(KeyboardInterrupt):
        pipe.train_step(x, y, F.mse_loss)
    assert not gpipe_threads()
    layer.armed = False
    assert torch.isfinite(pipe.train_step(x, y, F.mse_loss))


class Gate(nn.Module):
    """Holds its stage at the first call until ``release`` (bounded), after saying so."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.entered.set()
        self.release.wait(30)
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ctrl_c_in_the_caller_stops_every_worker_before_returning(schedule):
    """SIGINT lands in the main thread while it waits for the workers: they must stop too
    (not keep computing into the parameters' .grad, nor race the next step's state)."""
    torch.manual_seed(0)
    gate = Gate()
    model = nn.Sequential(nn.Linear(6, 6), gate, nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6))
    pipe = GPipe(model, balance=[2, 2, 1], chunks=8, schedule=schedule, seed=SEED)
    x, y = torch.randn(16, 6), torch.randn(16, 6)

    def on_sigint(signum, frame):  # runs in the caller's thread, mid-step: let the held stage go on
        gate.release.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    interrupter = threading.Thread(target=lambda: gate.entered.wait(30) and os.kill(os.getpid(), signal.SIGINT))
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe.train_step(x, y, F.mse_loss)
    finally:
        interrupter.join(30)
        signal.signal(signal.SIGINT, previous)
    wait_for_stage_threads(10)  # a worker that has finished its walk may not be idle yet
    assert not gpipe_threads(), "worker threads still running after Ctrl-C"
    assert all(not s._saved and s.live_bytes == 0 for s in pipe.stages)
    model.zero_grad(set_to_none=True)
    loss = pipe.train_step(x, y, F.mse_loss)
    plain = nn.Sequential(*[m for m in model if not isinstance(m, Gate)])
    assert torch.allclose(loss, F.mse_loss(plain(x), y), atol=1e-6)


class Counting(nn.Module):
    """Counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("queued", [False, True], ids=["before-queueing", "after-queueing"])
def test_ctrl_c_inside_submit_cancels_the_unstarted_rank_at_once(queued, monkeypatch):
    """A Ctrl-C can land while the caller hands rank 2 its task. The step raises without waiting for
    that task (not queued, it never begins); a queued task that begins after the interrupt returns
    without running anything; the pipe stays clean and the next step is exact."""
    torch.manual_seed(0)
    last = Counting()
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), last)
    pipe = GPipe(model, balance=[1, 1, 2], chunks=4, seed=SEED, timeout=300)
    workers = pipe.executor.workers
    submit = workers.submit
    hold, handed = threading.Event(), []

    def interrupted_submit(rank, task):
        if rank != 2:
            return submit(rank, task)
        handed.append(task)
        if queued:  # the worker begins the task only after the caller was interrupted
            submit(rank, lambda: (hold.wait(30), task()))
        raise KeyboardInterrupt

    monkeypatch.setattr(workers, "submit", interrupted_submit)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with pytest.raises(KeyboardInterrupt):
        pipe.train_step(x, y, F.mse_loss)
    hold.set()
    monkeypatch.setattr(workers, "submit", submit)
    wait_for_stage_threads(30)
    step = handed[0].args[0]  # the task is ``partial(rank_thread, step, rank, device)``
    assert not step.running[2].is_set() and step.finished[2].is_set() == queued
    assert last.calls == 0, "the cancelled step's rank 2 ran a forward"
    assert not busy_stage_threads() and all(not s._saved and s.live_bytes == 0 for s in pipe.stages)
    loss = pipe.train_step(x, y, F.mse_loss)
    assert torch.allclose(loss, F.mse_loss(model(x), y), atol=1e-6)

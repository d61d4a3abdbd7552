"""Stage workers live across steps: thread-local state survives, busy or idle workers are replaced."""

from __future__ import annotations

import gc
import multiprocessing
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline.step.workers import StageWorker, StageWorkers


class ThreadProbe(nn.Module):
    """Records the thread of every forward and a per-thread counter (as cuDNN keeps its plans)."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.local.calls = getattr(self.local, "calls", 0) + 1
        self.seen.append((threading.get_ident(), self.local.calls))
        return x


def test_every_step_runs_a_stage_on_the_same_thread_so_thread_local_caches_survive() -> None:
    probe = ThreadProbe()
    # the least work after the step (no verdict, no memory counting): the next step comes soonest
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), probe), balance=[1, 1], chunks=2, checkpoint="never",
                 nonfinite="ignore", track_memory=False)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(20):
        pipe.train_step(x, y, F.mse_loss)
    threads = {ident for ident, _ in probe.seen}
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert [calls for _, calls in probe.seen] == list(range(1, 41))  # 2 micro-batches x 20 steps, one thread
    workers = pipe.executor.workers.threads()
    assert sorted(w.name for w in workers) == ["gpipe-stage-0", "gpipe-stage-1"]
    assert all(w.idle.is_set() for w in workers)


def test_a_busy_worker_is_replaced_and_ends_after_its_task() -> None:
    workers = StageWorkers()
    release, ran = threading.Event(), threading.Event()
    first = workers.submit(0, lambda: release.wait(30))
    second = workers.submit(0, ran.set)  # the first still runs: a fresh worker takes it
    assert second is not first and ran.wait(30)
    release.set()
    first.join(30)
    assert not first.is_alive()
    assert workers.submit(0, ran.set) is second  # idle again: reused


def test_a_worker_finishing_its_task_is_kept_not_replaced() -> None:
    """A step's rank task signals the step before it returns: the next submit may find the
    worker a moment from idle, and must wait for it rather than start a new thread."""
    workers = StageWorkers()
    for _ in range(50):
        signalled, release, ran = threading.Event(), threading.Event(), threading.Event()
        first = workers.submit(0, lambda s=signalled, r=release: (s.set(), r.wait(30)))
        assert signalled.wait(30)
        release.set()  # the task is returning now
        assert workers.submit(0, ran.set) is first and ran.wait(30)


def test_an_idle_worker_ends_by_itself_and_is_replaced() -> None:
    workers = StageWorkers(idle_exit=0.05)
    first = workers.submit(0, lambda: None)
    first.join(30)
    assert not first.is_alive() and not first.try_submit(lambda: None)
    done = threading.Event()
    assert workers.submit(0, done.set) is not first and done.wait(30)


def test_a_collected_pipe_leaves_no_thread() -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), balance=[1, 1], chunks=2)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    workers = pipe.executor.workers.threads()
    assert len(workers) == 2
    del pipe
    gc.collect()
    for w in workers:
        w.join(30)
    assert not any(w.is_alive() for w in workers)


def _step_in_child(pipe: GPipe, x: torch.Tensor, y: torch.Tensor, conn) -> None:  # noqa: ANN001
    conn.send(pipe.train_step(x, y, F.mse_loss).item())


@pytest.mark.timeout(120)
def test_a_forked_child_replaces_the_parents_workers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = GPipe(model, balance=[1, 1], chunks=2, checkpoint="never")
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    expected = pipe.train_step(x, y, F.mse_loss).item()  # the parent's workers now exist
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_step_in_child, args=(pipe, x, y, send))
    child.start()
    try:
        assert receive.poll(60), "the forked child's step did not finish"
        assert receive.recv() == pytest.approx(expected, abs=1e-6)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert isinstance(pipe.executor.workers.threads()[0], StageWorker)

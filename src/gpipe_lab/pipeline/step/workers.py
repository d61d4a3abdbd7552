"""Long-lived stage threads: one per hosted rank, reused by every step of a pipe.

A thread per step would be simpler, but state that libraries keep per thread dies
with the thread: PyTorch's cuDNN attention keeps its execution plans in
thread-local caches, so a fresh thread rebuilds them for every forward and
backward of every step (README "GPUs"; ``results/gpu_runs/trace_gaps_16ef4af.txt``). A worker runs one task at
a time from its queue:

* a rank whose worker is still busy after ``FINISHING_S`` (a computation that outlived
  a failed step's timeout) gets a fresh worker; the old one ends after its task;
* a worker idle for ``idle_exit`` seconds ends by itself, and the pool retires
  its workers when the pipe is collected: idle pipes hold no threads for long;
* after ``fork`` the child's copies of the workers are not alive and are replaced.

``StageWorker.idle`` is set whenever the worker runs no task: after a step, every
worker of the pipe is idle.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

#: seconds a worker waits for its next task before it ends
IDLE_EXIT_S = 60.0
#: seconds to wait for a busy worker to go idle before replacing it: a step's rank task signals
#: the step before it returns, so the next step can find its worker a moment from idle
FINISHING_S = 0.1


class StageWorker(threading.Thread):
    """A daemon thread named ``name`` that runs submitted tasks one after another."""

    def __init__(self, name: str, idle_exit: float = IDLE_EXIT_S) -> None:
        super().__init__(name=name, daemon=True)
        self.idle = threading.Event()
        self.idle.set()
        self._idle_exit = idle_exit
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def try_submit(self, task: Callable[[], None]) -> bool:
        """Queue ``task`` if this worker is alive and idle; False when it cannot take it."""
        with self._lock:
            if self._closed or not self.is_alive() or not self.idle.is_set():
                return False
            self.idle.clear()
            self._tasks.put(task)
            return True

    def retire(self) -> None:
        """End the thread after the task it runs, if any (idempotent)."""
        with self._lock:
            self._closed = True
        self._tasks.put(None)

    def run(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self._idle_exit)
            except queue.Empty:
                with self._lock:
                    if self.idle.is_set():  # nothing was submitted while the wait ran out
                        self._closed = True
                        return
                continue
            if task is None:
                return
            try:
                task()  # the task reports its own errors (the executor's rank threads catch all)
            finally:
                del task  # a finished task must not keep its pipe alive
                self.idle.set()


class StageWorkers:
    """The workers of one executor, keyed by rank."""

    def __init__(self, idle_exit: float = IDLE_EXIT_S) -> None:
        self.idle_exit = idle_exit
        self._workers: dict[int, StageWorker] = {}
        weakref.finalize(self, _retire_all, self._workers)

    def submit(self, rank: int, task: Callable[[], None]) -> StageWorker:
        """Run ``task`` on rank ``rank``'s worker, making a new worker when the last cannot take it."""
        worker = self._workers.get(rank)
        if worker is not None and (worker.try_submit(task)
                                   or (worker.idle.wait(FINISHING_S) and worker.try_submit(task))):
            return worker
        if worker is not None:
            worker.retire()
        worker = self._workers[rank] = StageWorker(f"gpipe-stage-{rank}", self.idle_exit)
        worker.start()
        if not worker.try_submit(task):  # a fresh, started worker always takes it
            raise RuntimeError(f"the new worker of rank {rank} refused its first task")
        return worker

    def threads(self) -> list[StageWorker]:
        """The workers alive now."""
        return [w for w in self._workers.values() if w.is_alive()]


def _retire_all(workers: dict[int, StageWorker]) -> None:
    for worker in workers.values():
        worker.retire()

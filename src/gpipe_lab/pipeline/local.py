"""Local channel: one process, one worker thread per pipeline rank, mailboxes between them.

Each worker walks its rank's action list (``channel.run_actions``) for the
stages it holds (one, or v virtual stages). Activations and gradients travel
through a mailbox keyed by (kind, destination stage, micro-batch). On CPU
devices every worker runs with its own share of the cores, and because the
backward of each stage is explicit, stages compute in parallel.

Failure: the first exception in any worker marks the mailbox failed, which
wakes every waiting worker; all threads end before ``run`` re-raises the
original exception (with the stage and action added to its message).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from gpipe_lab.pipeline.channel import StepFeed, Values, run_actions
from gpipe_lab.pipeline.errors import PipelineTimeoutError, annotate
from gpipe_lab.pipeline.schedules import Action, Schedule
from gpipe_lab.pipeline.stage import StageRuntime
from gpipe_lab.pipeline.streams import Streams, streams_for
from gpipe_lab.pipeline.timeline import Event


def caller_autocast() -> list[tuple[str, torch.dtype]]:
    """The autocast regions the calling thread is in, to re-enter in stage threads."""
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


class _Aborted(Exception):
    """Raised in a worker when another worker failed."""


class Mailbox:
    """Hand-over of boundary values between worker threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[tuple[str, int, int], object] = {}
        self.failed = False

    def put(self, key: tuple[str, int, int], value: object) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: tuple[str, int, int], deadline: float) -> object:
        """The value for ``key``.

        Raises:
            TimeoutError: nothing came before ``deadline`` (``time.monotonic()``).
            _Aborted: another worker failed.
        """
        with self._cond:
            while key not in self._items:
                if self.failed:
                    raise _Aborted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(key)
                self._cond.wait(remaining)
            return self._items.pop(key)

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()


class _Endpoint:
    """One worker's (rank's) side of the mailbox; hand-overs ordered by ``streams``."""

    def __init__(self, box: Mailbox, runtimes: Mapping[int, StageRuntime], deadline: float,
                 rank: int, device: torch.device, streams: Streams) -> None:
        self.box, self.runtimes, self.deadline = box, runtimes, deadline
        self.rank, self.device, self.streams = rank, device, streams

    def receive(self, key: tuple[str, int, int], action: Action) -> tuple[Values, bool]:
        if self.box.failed:  # another stage failed or the caller was interrupted: stop now
            raise _Aborted
        runtime = self.runtimes[action.stage]
        start = time.perf_counter()
        values, flag, mark = self.box.get(key, self.deadline)  # type: ignore[misc]
        runtime.events.append(Event(action.stage, "wait", action.microbatch, start, time.perf_counter()))
        if values is not None:
            values = self.streams.hand_over(values, mark, self.rank, runtime.device)
        return values, flag

    def send(self, key: tuple[str, int, int], values: Values, was_tensor: bool) -> None:
        self.box.put(key, (values, was_tensor, self.streams.mark(self.rank, self.device)))


class LocalChannel:
    """Runs every rank's list over ``StageRuntime`` objects, one thread per rank."""

    holds_all_stages = True

    def __init__(self, runtimes: Mapping[int, StageRuntime], num_ranks: int, threads_per_stage: int,
                 timeout: float) -> None:
        self.runtimes = dict(runtimes)
        self.ranks = list(range(num_ranks))
        self.num_stages = len(self.runtimes)
        self.threads_per_stage = threads_per_stage
        self.timeout = timeout
        self.streams: Streams = streams_for([r.device for r in self.runtimes.values()])

    def prepare(self, schedule: Schedule) -> Any:
        return None

    def share(self, vector: Tensor) -> Tensor:
        return vector

    def fail_early(self, exc: BaseException) -> None:
        return None

    def run(self, schedule: Schedule, prepared: Any, feed: StepFeed, sync_gradients: bool) -> None:
        """Execute ``schedule``; stage 0 reads ``feed.inputs``, the last stage ``feed.targets``.

        Raises:
            Exception: the first exception raised by any stage, re-raised with its
                original type after every worker has stopped.
            PipelineTimeoutError: a stage waited longer than the timeout.
        """
        box = Mailbox()
        deadline = time.monotonic() + self.timeout
        K = len(schedule)
        done: list[Action | None] = [None] * K
        current: list[Action | None] = [None] * K
        errors: list[tuple[float, int, Action | None, BaseException]] = []
        main_threads = torch.get_num_threads()
        finished = [threading.Event() for _ in range(K)]
        running = [threading.Event() for _ in range(K)]
        autocast = caller_autocast()

        def work(k: int) -> None:
            running[k].set()
            try:
                with ExitStack() as stack:
                    for device_type, dtype in autocast:  # autocast is per thread: carry the caller's
                        stack.enter_context(torch.autocast(device_type, dtype=dtype))
                    run_rank(k)
            finally:
                finished[k].set()

        def run_rank(k: int) -> None:
            actions = schedule[k]
            device = rank_devices[k]
            if device.type == "cpu":
                torch.set_num_threads(self.threads_per_stage)
            elif device.type == "cuda":
                torch.cuda.set_device(device)

            def after(i: int, action: Action) -> None:
                done[k] = action
                current[k] = actions[i + 1] if i + 1 < len(actions) else None
                if box.failed:
                    raise _Aborted

            current[k] = actions[0] if actions else None
            try:
                with self.streams.compute(k, device):
                    run_actions(actions, self.runtimes,
                                _Endpoint(box, self.runtimes, deadline, k, device, self.streams), feed,
                                self.num_stages, after)
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append((time.monotonic(), k, current[k], exc))
                box.fail()

        rank_devices = [self.runtimes[schedule[k][0].stage].device if schedule[k] else torch.device("cpu")
                        for k in range(K)]
        ranks = list(enumerate(rank_devices))
        self.streams.begin(ranks)  # the optimizer updated the parameters on the caller's stream
        threads = [threading.Thread(target=work, args=(k,), name=f"gpipe-stage-{k}", daemon=True)
                   for k in range(K)]
        launched: list[int] = []
        try:
            for k, t in enumerate(threads):
                launched.append(k)
                t.start()
            for t in threads:
                t.join()
        except BaseException:  # e.g. Ctrl-C in the caller: stop the workers before re-raising
            box.fail()
            # not t.join(): on Python < 3.12 an interrupted join() can mark a running thread stopped.
            # A Ctrl-C inside t.start() can leave a launched thread not yet running: wait for it to
            # begin (bounded: an interrupt before the OS thread was created means it never will).
            for k in launched:
                if running[k].wait(timeout=10.0):
                    finished[k].wait()
            self._abort()
            raise
        finally:
            torch.set_num_threads(main_threads)
            self.streams.finish(ranks)  # the caller reads losses and gradients on its own stream
        if errors:
            self._abort()
            real = [e for e in errors if not isinstance(e[3], TimeoutError)]
            _, k, action, exc = min(real or errors, key=lambda e: e[0])
            if isinstance(exc, TimeoutError):
                raise PipelineTimeoutError(self.timeout, done, current) from None
            raise annotate(exc, k if action is None else action.stage, action)

    def _abort(self) -> None:
        for runtime in self.runtimes.values():
            runtime.abort()

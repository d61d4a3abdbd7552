"""Local transport: one process, one worker thread per stage.

Each worker walks its stage's action list. Activations and gradients travel
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
from collections.abc import Sequence
from contextlib import ExitStack

import torch
from torch import Tensor

from gpipe_lab.pipeline.errors import PipelineTimeoutError, annotate
from gpipe_lab.pipeline.microbatch import to_device
from gpipe_lab.pipeline.schedule import Action, Schedule
from gpipe_lab.pipeline.stage import StageRuntime
from gpipe_lab.pipeline.timeline import Event


def caller_autocast() -> list[tuple[str, torch.dtype]]:
    """The autocast regions the calling thread is in, to re-enter in stage threads."""
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


class _Aborted(Exception):
    """Raised in a worker when another worker failed."""


class Mailbox:
    """Hand-over of boundary tensors between worker threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[tuple[str, int, int], object] = {}
        self.failed = False

    def put(self, key: tuple[str, int, int], value: object) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: tuple[str, int, int], deadline: float) -> object:
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


class LocalTransport:
    """Runs a schedule over ``StageRuntime`` objects with one thread each."""

    def __init__(self, stages: Sequence[StageRuntime], threads_per_stage: int) -> None:
        self.stages = list(stages)
        self.threads_per_stage = threads_per_stage

    def run(self, schedule: Schedule, inputs: Sequence[tuple[Tensor, ...]], input_was_tensor: bool,
            targets: Sequence[object] | None, timeout: float) -> None:
        """Execute ``schedule``; stage 0 reads ``inputs``, the last stage ``targets``.

        Raises:
            Exception: the first exception raised by any stage, re-raised with its
                original type after every worker has stopped.
            PipelineTimeoutError: a stage waited longer than ``timeout`` seconds.
        """
        box = Mailbox()
        deadline = time.monotonic() + timeout
        num_stages = len(self.stages)
        done: list[Action | None] = [None] * num_stages
        current: list[Action | None] = [None] * num_stages
        errors: list[tuple[float, int, Action | None, BaseException]] = []
        main_threads = torch.get_num_threads()
        finished = [threading.Event() for _ in range(num_stages)]
        autocast = caller_autocast()

        def work(k: int) -> None:
            try:
                with ExitStack() as stack:
                    for device_type, dtype in autocast:  # autocast is per thread: carry the caller's
                        stack.enter_context(torch.autocast(device_type, dtype=dtype))
                    run_stage(k)
            finally:
                finished[k].set()

        def run_stage(k: int) -> None:
            stage = self.stages[k]
            if stage.device.type == "cpu":
                torch.set_num_threads(self.threads_per_stage)
            elif stage.device.type == "cuda":
                torch.cuda.set_device(stage.device)
            action = None
            try:
                for action in schedule[k]:
                    if box.failed:  # another stage failed or the caller was interrupted: stop now
                        raise _Aborted
                    current[k] = action
                    mb = action.microbatch
                    if action.kind == "F":
                        if k == 0:
                            values, was_tensor = to_device(inputs[mb], stage.device), input_was_tensor
                        else:
                            values, was_tensor = self._receive(box, ("F", k, mb), k, deadline, stage)
                        target = targets[mb] if targets is not None and stage.is_last else None
                        outputs, out_tensor = stage.forward(mb, values, was_tensor, target)
                        if k < num_stages - 1:
                            box.put(("F", k + 1, mb), (outputs, out_tensor))
                    elif action.kind == "B":
                        grads = None
                        stage.rematerialize(mb)  # overlaps the wait for the gradient
                        if k < num_stages - 1:
                            grads, _ = self._receive(box, ("B", k, mb), k, deadline, stage)
                        grads_in = stage.backward(mb, grads)
                        if k > 0:
                            box.put(("B", k - 1, mb), (grads_in, False))
                    else:
                        stage.weight_backward(mb)
                    done[k] = action
                current[k] = None
            except _Aborted:
                pass
            except TimeoutError as exc:
                errors.append((time.monotonic(), k, action, exc))
                box.fail()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append((time.monotonic(), k, action, exc))
                box.fail()

        threads = [threading.Thread(target=work, args=(k,), name=f"gpipe-stage-{k}", daemon=True)
                   for k in range(num_stages)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException:  # e.g. Ctrl-C in the caller: stop the workers before re-raising
            box.fail()
            # not t.join(): on Python < 3.12 an interrupted join() can mark a running thread stopped
            for t, event in zip(threads, finished):
                if t.ident is not None:
                    event.wait()
            for stage in self.stages:
                stage.abort()
            raise
        finally:
            torch.set_num_threads(main_threads)
        if errors:
            for stage in self.stages:
                stage.abort()
            real = [e for e in errors if not isinstance(e[3], TimeoutError)]
            _, k, action, exc = min(real or errors, key=lambda e: e[0])
            if isinstance(exc, TimeoutError):
                raise PipelineTimeoutError(timeout, done, current) from None
            raise annotate(exc, k, action)

    @staticmethod
    def _receive(box: Mailbox, key: tuple[str, int, int], k: int, deadline: float,
                 stage: StageRuntime) -> tuple:
        start = time.perf_counter()
        values, flag = box.get(key, deadline)  # type: ignore[misc]
        stage.events.append(Event(k, "wait", key[2], start, time.perf_counter()))
        if values is not None:
            values = tuple(None if v is None else v.to(stage.device, non_blocking=True) for v in values)
        return values, flag

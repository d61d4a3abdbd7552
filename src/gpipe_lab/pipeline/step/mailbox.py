"""The one mailbox of a step: boundary values keyed by message, waited for with a per-wait limit.

Every transport delivers into it (a local sender directly, the distributed
receiver threads as messages arrive) and the executor takes from it. A wait is
bounded by ``timeout`` seconds counted from its own start, as
``PipelineOptions.timeout`` documents, not by a deadline for the whole step.

A hand-over is on every action's path, so it uses the interpreter's raw locks
only: a waiter parks on a lock of its own that the matching ``put`` (or ``stop``,
or a broken link) releases, instead of a ``threading.Condition`` that wakes every
waiter and builds its wait in Python.
"""

from __future__ import annotations

import _thread
import time
from collections.abc import Callable
from typing import Any

from gpipe_lab.pipeline.schedules import MessageKey

POLL_SECONDS = 0.05  # how often a wait runs its ``poll`` (e.g. looks for another rank's abort)


class Stopped(Exception):
    """The step is being stopped (a rank failed, or the caller was interrupted)."""


class WaitTimeout(Exception):
    """Nothing came for ``key`` within the timeout."""

    def __init__(self, key: MessageKey, timeout: float) -> None:
        super().__init__(f"waited more than {timeout:g} s for {key}")
        self.key, self.timeout = key, timeout


class Undelivered(Exception):
    """The delivery from ``peer`` failed (``cause``), so ``key`` can never come."""

    def __init__(self, key: MessageKey, peer: int, cause: BaseException) -> None:
        super().__init__(f"{key} from rank {peer}: {cause}")
        self.key, self.peer, self.cause = key, peer, cause


class Mailbox:
    """Values handed over during one step, keyed by (kind, receiving stage, micro-batch)."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._items: dict[MessageKey, tuple[Any, ...]] = {}  # each transport's own item
        self._waiters: dict[MessageKey, _thread.LockType] = {}  # a held lock per waiting key
        self._broken: tuple[int, BaseException] | None = None
        self.stopped = False

    def put(self, key: MessageKey, item: tuple[Any, ...]) -> None:
        with self._lock:
            self._items[key] = item
            waiter = self._waiters.pop(key, None)
        if waiter is not None:
            waiter.release()

    def _wake_all(self) -> None:
        """Release every parked waiter (called with ``_lock`` held); each re-checks why."""
        for waiter in self._waiters.values():
            waiter.release()
        self._waiters.clear()

    def break_link(self, peer: int, cause: BaseException) -> None:
        """A delivery from ``peer`` failed: waits for what it has not delivered fail with ``cause``."""
        with self._lock:
            if self._broken is None:
                self._broken = (peer, cause)
            self._wake_all()

    def stop(self) -> None:
        """Wake every wait: it raises ``Stopped``."""
        with self._lock:
            self.stopped = True
            self._wake_all()

    def get(self, key: MessageKey, timeout: float, poll: Callable[[], None] | None = None) -> tuple[Any, ...]:
        """Take the item for ``key``; ``poll()`` runs every ``POLL_SECONDS`` while waiting.

        What was delivered before a link broke is still handed out.

        Raises:
            Stopped: the step is being stopped.
            Undelivered: a link broke before ``key`` came.
            WaitTimeout: nothing came within ``timeout`` seconds of this call.
            Exception: whatever ``poll`` raises.
        """
        lock = self._lock
        with lock:
            item = self._items.pop(key, None)
        if item is not None:
            return item
        limit = time.monotonic() + timeout
        while True:
            with lock:
                item = self._items.pop(key, None)
                if item is not None:
                    return item
                if self.stopped:
                    raise Stopped
                if self._broken is not None:
                    raise Undelivered(key, *self._broken)
                waiter = self._waiters.get(key)
                if waiter is None:
                    waiter = self._waiters[key] = _thread.allocate_lock()
                    waiter.acquire()
            if poll is not None:
                poll()
            remaining = limit - time.monotonic()
            if remaining <= 0:
                with lock:
                    item = self._items.pop(key, None)
                    if item is None and self._waiters.get(key) is waiter:
                        del self._waiters[key]
                if item is not None:
                    return item
                raise WaitTimeout(key, timeout)
            # released by the key's put, by stop or by a broken link; else a poll interval passed
            waiter.acquire(timeout=min(remaining, POLL_SECONDS))

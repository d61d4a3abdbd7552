"""The one mailbox of a step: boundary values keyed by message, waited for with a per-wait limit.

Every transport delivers into it (a local sender directly, the distributed
receiver threads as messages arrive) and the executor takes from it. A wait is
bounded by ``timeout`` seconds counted from its own start, as
``PipelineOptions.timeout`` documents, not by a deadline for the whole step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
        self._cond = threading.Condition()
        self._items: dict[MessageKey, tuple] = {}
        self._broken: tuple[int, BaseException] | None = None
        self.stopped = False

    def put(self, key: MessageKey, item: tuple) -> None:
        with self._cond:
            self._items[key] = item
            self._cond.notify_all()

    def break_link(self, peer: int, cause: BaseException) -> None:
        """A delivery from ``peer`` failed: waits for what it has not delivered fail with ``cause``."""
        with self._cond:
            if self._broken is None:
                self._broken = (peer, cause)
            self._cond.notify_all()

    def stop(self) -> None:
        """Wake every wait: it raises ``Stopped``."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def get(self, key: MessageKey, timeout: float, poll: Callable[[], None] | None = None) -> tuple:
        """Take the item for ``key``; ``poll()`` runs every ``POLL_SECONDS`` while waiting.

        What was delivered before a link broke is still handed out.

        Raises:
            Stopped: the step is being stopped.
            Undelivered: a link broke before ``key`` came.
            WaitTimeout: nothing came within ``timeout`` seconds of this call.
            Exception: whatever ``poll`` raises.
        """
        limit = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                if self.stopped:
                    raise Stopped
                if self._broken is not None:
                    raise Undelivered(key, *self._broken)
                if poll is not None:
                    self._cond.release()
                    try:
                        poll()
                    finally:
                        self._cond.acquire()
                    if key in self._items:
                        break
                remaining = limit - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(key, timeout)
                self._cond.wait(min(remaining, POLL_SECONDS))
            return self._items.pop(key)

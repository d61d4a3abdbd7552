"""Sends in flight: each one's ``Work`` and tensor are let go the moment it completes.

A sent tensor must stay alive until its send is done, but no longer: a
checkpointed micro-batch's output is referenced by nothing else, so holding it
to the end of the step would keep every micro-batch's output alive at once.
One helper thread per step waits for the sends in the order they were started
(gloo's point-to-point ``Work`` never reports ``is_completed()``, so only a
blocked ``wait()`` observes completion; an NCCL ``Work`` is polled until the
device finished, and waited only then: ``wait()`` on an unfinished one would make
this thread's current stream, the device's default stream, wait for the peer)
and drops both references as soon as each one is done.

``close`` waits (bounded, polling the abort channel) until every send is done.
"""

from __future__ import annotations

import queue
import threading

from torch import Tensor

from gpipe_lab.pipeline.distributed.failure import _NCCL_POLL_SECONDS, AbortChannel, _completed, wait_works
from gpipe_lab.pipeline.distributed.wire import PeerWork, Pending

WHAT = "sending activations/gradients"


class InFlightSends:
    """The sends of one step, released one by one as they complete."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[PeerWork, Tensor] | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._outstanding = 0
        self._failure: tuple[BaseException, PeerWork] | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.peer: int | None = None  # the failed send's rank, read by ``wait_works``
        self.released = 0  # sends whose references were dropped (for tests and probes)

    def add(self, pending: Pending) -> None:
        """Track sends just started; their tensors are referenced here only until they complete."""
        with self._lock:
            self._outstanding += len(pending)
        for item in pending:
            self._queue.put(item)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpipe-send-completion", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, tensor = item
            del item
            try:
                if self._failure is None and not self._stopped.is_set():
                    on_device = getattr(tensor, "is_cuda", False)
                    if not on_device:
                        work.wait()
                    while not _completed(work) and not self._stopped.is_set():
                        self._stopped.wait(_NCCL_POLL_SECONDS)
                    if on_device and not self._stopped.is_set():
                        work.wait()  # done already: only surfaces an error, orders nothing
            except BaseException as exc:  # noqa: BLE001 - raised by ``close`` in the rank's thread
                if self._failure is None:
                    self._failure = (exc, work)
            del work, tensor  # the send is done: its buffer may be freed now
            with self._lock:
                self._outstanding -= 1
                self.released += 1
                self._lock.notify_all()

    def wait(self) -> None:
        """Block until every tracked send completed (``wait_works`` bounds this wait).

        Raises:
            BaseException: the first failed send's error (``self.peer`` names its rank).
        """
        with self._lock:
            self._lock.wait_for(lambda: self._outstanding == 0 or self._failure is not None)
        if self._failure is not None:
            exc, work = self._failure
            self.peer = getattr(work, "peer", None)
            raise exc

    def idle(self, timeout: float) -> bool:
        """Whether every send started so far has completed and been released, within ``timeout`` s."""
        with self._lock:
            return self._lock.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self, timeout: float, abort: AbortChannel) -> None:
        """Wait until every send is done, then stop the helper thread.

        Raises:
            PeerFailedError: a send failed (naming its rank) or another rank aborted.
            PeerTimeoutError: the sends did not complete within ``timeout`` seconds.
        """
        try:
            if self._thread is not None:
                wait_works([self], WHAT, None, timeout, abort)
        finally:
            self.discard()

    def discard(self) -> None:
        """Stop waiting for what is still in flight (after a failure); never raises."""
        self._stopped.set()
        self._queue.put(None)

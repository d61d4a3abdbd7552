"""Failing fast across ranks: a store side channel, bounded waits, errors naming ranks.

A rank that raises writes ``gpipe/abort`` (with who failed where) into the
job's key-value store before re-raising. Every wait in the distributed
transport polls: each ~50 ms it looks for that key and checks its deadline, so
a failure anywhere stops every rank within ``timeout`` seconds, with an error
that names the failing rank, stage and micro-batch. A rank that dies closes its
connections: its neighbours' receives fail at once (``PeerFailedError``), and a
rank that stops answering hits the deadline (``PeerTimeoutError``).

gloo's point-to-point ``Work`` never reports ``is_completed()`` and a timed-out
``wait(timeout)`` tears down the whole context, so completion is observed by a
helper thread blocked in ``wait()`` while the caller polls.

After a failure the process group is unusable; end the process (``os._exit``
avoids the shutdown wait of pending gloo operations).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from gpipe_lab.pipeline.errors import PipelineTimeoutError

ABORT_KEY = "gpipe/abort"
POLL_SECONDS = 0.05


class PeerFailedError(RuntimeError):
    """Another rank failed (its message is included) or became unreachable."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = rank


class PeerTimeoutError(PipelineTimeoutError):
    """This rank waited longer than the timeout for a peer rank."""

    def __init__(self, message: str, rank: int | None, timeout: float) -> None:
        TimeoutError.__init__(self, message)
        self.failed_rank = rank
        self.timeout = timeout
        self.done: list = []
        self.waiting: list = []


class AbortChannel:
    """The ``gpipe/abort`` key of the default store, checked at most every ``POLL_SECONDS``."""

    def __init__(self, store: object, rank: int) -> None:
        self.store = store
        self.rank = rank
        self._next_check = 0.0
        self.message: str | None = None

    def signal(self, message: str) -> None:
        """Tell every rank to stop (best effort: the store host may be gone)."""
        if self.store is None or self.message is not None:
            return
        self.message = message
        try:
            self.store.set(ABORT_KEY, message)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the store host may be the rank that died
            self.store = None

    def check(self, force: bool = False) -> None:
        """Raises:
            PeerFailedError: another rank signalled an abort (its message is included).
        """
        now = time.monotonic()
        if self.store is None or (not force and now < self._next_check):
            return
        self._next_check = now + POLL_SECONDS
        try:
            if not self.store.check([ABORT_KEY]):  # type: ignore[attr-defined]
                return
            message = self.store.get(ABORT_KEY).decode()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - store unreachable: rely on link errors and deadlines
            self.store = None
            return
        if message != self.message:
            raise PeerFailedError(f"rank {self.rank} stopped because {message}",
                                  _rank_in(message))


def _rank_in(message: str) -> int | None:
    words = message.split()
    if len(words) > 1 and words[0] == "rank" and words[1].isdigit():
        return int(words[1])
    return None


def wait_works(works: Sequence[object], what: str, peer: int | None, timeout: float,
               abort: AbortChannel) -> None:
    """Wait for Work handles without ever hanging.

    Raises:
        PeerFailedError: a peer signalled an abort, or the operation failed
            (e.g. the peer's connection closed).
        PeerTimeoutError: not done within ``timeout`` seconds.
    """
    if not works:
        return
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for w in works:
                w.wait()  # type: ignore[attr-defined]
        except BaseException as exc:  # noqa: BLE001 - handed to the polling thread
            errors.append(exc)
        done.set()

    threading.Thread(target=run, name="gpipe-wait", daemon=True).start()
    deadline = time.monotonic() + timeout
    peer_name = "a peer rank" if peer is None else f"rank {peer}"
    while not done.wait(POLL_SECONDS):
        abort.check()
        if time.monotonic() > deadline:
            raise PeerTimeoutError(f"rank {abort.rank} waited more than {timeout:g} s for {peer_name} "
                                   f"({what}); is it alive?", peer, timeout)
    if errors:
        abort.check(force=True)  # a link closed because a rank failed: name it (its abort message) if it did
        raise PeerFailedError(f"rank {abort.rank}: {what} with {peer_name} failed: {errors[0]}",
                              peer) from errors[0]

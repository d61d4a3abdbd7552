"""Failing fast across ranks: a store side channel, bounded waits, errors naming ranks.

A rank that raises writes ``gpipe/abort`` (with who failed where) into the
job's key-value store before re-raising. Every wait in the distributed
transport polls: each ~50 ms it looks for that key, checks its deadline and
asks the kernel whether a peer it waits for is gone (``liveness``), so a failure
anywhere stops every rank within ``timeout`` seconds, with an error that names
the failing rank, stage and micro-batch.

A rank that dies closes its connections: a send, a receive or a collective of
a survivor then fails, whatever it was doing, with ``PeerFailedError`` naming the
rank(s) that went away and where the survivor was (``[in stage k, <action>]``).
Which rank that is comes, in order, from another rank's abort message, from the
processes found gone, or from the failed link's peer. A rank that stops
answering hits the deadline (``PeerTimeoutError``).

gloo's point-to-point ``Work`` never reports ``is_completed()`` and a timed-out
``wait(timeout)`` tears down the whole context, so completion is observed by a
helper thread blocked in ``wait()`` while the caller polls.

After a failure the process group is unusable (its links may hold receives and sends of the
failed step); end the process (``os._exit`` avoids the shutdown wait of pending gloo
operations). What would wait on it raises ``GroupUnusableError`` at once instead: a new
``DistributedGPipe`` (the abort key is in the store) and a pipe's next step (its rank knows).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Protocol, cast

import torch.distributed as dist

from gpipe_lab.pipeline.distributed.liveness import PeerTable
from gpipe_lab.pipeline.errors import PipelineTimeoutError
from gpipe_lab.pipeline.schedules import Action

ABORT_KEY = "gpipe/abort"
POLL_SECONDS = 0.05


class PeerFailedError(RuntimeError):
    """Another rank failed (its message is included) or went away.

    ``failed_rank`` is the first rank named (``None``: unknown), ``failed_ranks`` all of them.
    """

    def __init__(self, message: str, rank: int | None = None, ranks: Sequence[int] | None = None) -> None:
        super().__init__(message)
        self.failed_ranks: tuple[int, ...] = tuple(ranks) if ranks else (() if rank is None else (rank,))
        self.failed_rank = self.failed_ranks[0] if self.failed_ranks else None
        self.explained = False


class PeerTimeoutError(PipelineTimeoutError):
    """This rank waited longer than the timeout for a peer rank."""

    def __init__(self, message: str, rank: int | None, timeout: float) -> None:
        TimeoutError.__init__(self, message)
        self.failed_rank = rank
        self.timeout = timeout
        self.done: list[Action | None] = []
        self.waiting: list[Action | None] = []


class GroupUnusableError(RuntimeError):
    """A step failed earlier on this process group, so nothing more can run on it.

    ``failed_ranks``: the ranks the earlier failure names; ``failure``: its message."""

    def __init__(self, what: str, failure: str) -> None:
        super().__init__(f"{what} refused: a step failed earlier on this process group ({failure}); its "
                         "links may still hold that step's messages, so nothing more can run on it: restart "
                         "the processes (a new process group), e.g. from the last checkpoint")
        self.failure = failure
        self.failed_ranks: tuple[int, ...] = tuple(ranks_in(failure))


def refuse_failed_group() -> None:
    """Refuse to build a pipeline on a process group on which a step failed (the abort key is set).

    Raises:
        GroupUnusableError: naming the earlier failure (its rank and message).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    store = dist.distributed_c10d._get_default_store()
    try:
        failure = store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None
    except Exception:  # noqa: BLE001 - store unreachable: the set-up's own exchanges report it
        return
    if failure is not None:
        raise GroupUnusableError("DistributedGPipe()", failure)


def who(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def ranks_in(message: str) -> list[int]:
    """The ranks a message starting with ``rank N`` / ``ranks N, M`` names."""
    words = message.replace(",", " ").split()
    if not words or words[0] not in ("rank", "ranks"):
        return []
    out = []
    for w in words[1:]:
        if not w.isdigit():
            break
        out.append(int(w))
    return out


class AbortChannel:
    """The ``gpipe/abort`` key of the default store, checked at most every ``POLL_SECONDS``,
    and the table of peer processes. ``stage`` (this rank's pipeline stage) only labels errors;
    ``world_size`` defaults to the default process group's (1 without one)."""

    def __init__(self, store: dist.Store | None, rank: int, stage: int | None = None,
                 world_size: int | None = None) -> None:
        self.store = store
        self.rank = rank
        self.stage = stage
        self._next_check = 0.0
        #: seconds between two reads of the store (each action's and each wait's check)
        self.poll_seconds = POLL_SECONDS
        self.message: str | None = None  # this rank's announcement
        self.failure: str | None = None  # the first failure this rank knew of: its own or another's
        world = world_size if world_size is not None else (
            dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
        self.peers = PeerTable(store, rank, world)
        self.world_size = world

    def signal(self, message: str) -> None:
        """Tell every rank to stop (best effort: the store host may be gone).

        Returns once the store holds the message: a peer that later finds this process
        ended reads the message instead of naming this rank as gone."""
        if self.store is None or self.message is not None:
            return
        self.message = message
        self.failure = self.failure or message
        try:
            self.store.set(ABORT_KEY, message)
            # TCPStore's set returns before its server has stored the key; the server answers
            # one connection's requests in order, so this reply comes after the key is stored
            self.store.check([ABORT_KEY])
        except Exception:  # noqa: BLE001 - the store host may be the rank that died
            self.store = None

    def _read(self) -> str | None:
        """Another rank's abort message, if there is one."""
        if self.store is None:
            return None
        try:
            if not self.store.check([ABORT_KEY]):
                return None
            message = self.store.get(ABORT_KEY).decode()
        except Exception:  # noqa: BLE001 - store unreachable: rely on link errors and deadlines
            self.store = None
            return None
        if message == self.message:
            return None
        self.failure = self.failure or message
        return message

    def refuse_reuse(self, what: str) -> None:
        """Raises:
            GroupUnusableError: a step failed on this process group before (``what`` is refused).
        """
        if self.failure is not None:
            raise GroupUnusableError(what, self.failure)

    def check(self, force: bool = False) -> None:
        """Raises:
            PeerFailedError: another rank signalled an abort (its message is included).
        """
        now = time.monotonic()
        if self.store is None or (not force and now < self._next_check):
            return
        self._next_check = now + self.poll_seconds
        self.peers.refresh()
        message = self._read()
        if message is not None:
            raise PeerFailedError(f"rank {self.rank} stopped because {message}", ranks=ranks_in(message))

    def others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def where(self, what: str) -> str:
        return what if self.stage is None else f"stage {self.stage}, {what}"

    def explain(self, what: str, peers: Iterable[int], cause: BaseException | None, where: str) -> PeerFailedError:
        """The error of a survivor whose ``what`` with ``peers`` failed, ``where`` it was; announced
        to every rank. Another rank's abort message wins (it knows more), then the peers whose
        process is gone, then the peer itself when there is only one."""
        peers = sorted(set(peers))
        message = self._read()
        gone = self.peers.gone(peers) if message is None else []
        message = self._read() if message is None else message  # a survivor announces before it exits
        cause_text = "" if cause is None else f": {cause}"
        if message is not None:
            error = PeerFailedError(f"rank {self.rank} stopped because {message}; it was {what}{cause_text} "
                                    f"[in {where}]", ranks=ranks_in(message))
        elif gone:
            error = PeerFailedError(f"rank {self.rank}: {who(gone)} went away (process ended) while "
                                    f"{what}{cause_text} [in {where}]", ranks=gone)
            self.signal(f"{who(gone)} went away (seen by rank {self.rank} in {where}){cause_text}")
        else:
            named = peers if len(peers) == 1 else []
            error = PeerFailedError(f"rank {self.rank}: {what} failed; is {who(named) if named else 'a peer rank'} "
                                    f"alive?{cause_text} [in {where}]", ranks=named)
            if named:
                self.signal(f"{who(named)} failed or stopped answering (seen by rank {self.rank} in "
                            f"{where}){cause_text}")
        error.explained = True
        if cause is not None:
            error.__cause__ = cause
        return error

    def explain_error(self, exc: PeerFailedError, where: str) -> PeerFailedError:
        """``explain`` a link error raised without knowing where the survivor was; another
        rank's abort message seen while polling only gets ``where``."""
        if exc.explained:
            return exc
        if str(exc).startswith(f"rank {self.rank} stopped because"):
            exc.args = (f"{exc.args[0]} [in {where}]",)
            exc.explained = True
            return exc
        return self.explain(str(exc), exc.failed_ranks, exc.__cause__, where)


def link_error(what: str, peer: int, cause: BaseException) -> PeerFailedError:
    """A failed operation on the link with ``peer``, to ``explain`` where the survivor is known."""
    error = PeerFailedError(what, peer)
    error.__cause__ = cause
    return error


_NCCL_POLL_SECONDS = 0.0005


def _completed(work: object) -> bool:
    """Whether a Work finished on the device too (Works without ``is_completed``: yes)."""
    check = getattr(work, "is_completed", None)
    return True if check is None else bool(check())


class Waitable(Protocol):
    """What ``wait_works`` waits for: a ``dist.Work``, a ``wire.PeerWork``, ``sends.InFlightSends``."""

    def wait(self) -> object: ...


def wait_works(works: Sequence[Waitable], what: str, peer: int | Sequence[int] | None, timeout: float,
               abort: AbortChannel) -> None:
    """Wait for Work handles without ever hanging.

    ``peer``: the rank (or ranks) the operation involves; ``None``: any other rank,
    or the ``peer`` attribute of each Work (``wire.send_values``).

    Raises:
        PeerFailedError: a peer signalled an abort, went away, or the operation failed
            (e.g. the peer's connection closed).
        PeerTimeoutError: not done within ``timeout`` seconds.
    """
    if not works:
        return
    done, given_up = threading.Event(), threading.Event()
    failed: list[tuple[BaseException, Waitable]] = []

    def run() -> None:
        for w in works:
            try:
                w.wait()
                # NCCL's wait() only orders the current stream after the work and returns at
                # once: poll its completion, so a stuck peer meets the deadline below
                while not _completed(w) and not given_up.is_set():
                    given_up.wait(_NCCL_POLL_SECONDS)
            except BaseException as exc:  # noqa: BLE001 - handed to the polling thread
                failed.append((exc, w))
                break
        done.set()

    if peer is None:
        own = [getattr(w, "peer", None) for w in works]
        peers = abort.others() if None in own else sorted(set(cast("list[int]", own)))
    else:
        peers = [peer] if isinstance(peer, int) else list(peer)
    where = abort.where(what)
    threading.Thread(target=run, name="gpipe-wait", daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while not done.wait(POLL_SECONDS):
            try:
                abort.check()
            except PeerFailedError as exc:
                raise abort.explain_error(exc, where) from None
            if abort.peers.gone(peers):  # a member is gone: the operation can never complete
                raise abort.explain(what, peers, None, where)
            if time.monotonic() > deadline:
                names = "a peer rank" if len(peers) != 1 else f"rank {peers[0]}"
                late = PeerTimeoutError(f"rank {abort.rank} waited more than {timeout:g} s for {names} "
                                        f"({what}); is it alive? [in {where}]",
                                        peers[0] if len(peers) == 1 else None, timeout)
                abort.failure = abort.failure or str(late)  # the wait it gave up may still complete
                raise late
    finally:
        given_up.set()  # the waiter thread stops polling a Work nobody waits for any more
    if failed:
        error, work = failed[0]
        culprit = getattr(work, "peer", None)
        raise abort.explain(what, peers if culprit is None else [culprit], error, where) from error

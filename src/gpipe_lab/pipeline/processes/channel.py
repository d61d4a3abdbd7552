"""The endpoint of one process of the local transport's process mode (see ``channel.Endpoint``).

Each process hosts one pipeline rank. A value for a rank of another process goes
through a pipe to that process (``wire``), where a receiver thread per incoming pipe,
alive as long as the channel, puts it into the step's mailbox. Every message carries
the step's serial number: a value sent before the receiving process opened that step
waits until it does, and one left over from a failed step is dropped.

A failure is announced through a shared flag (``abort``: the failing rank + 1) that every
wait polls, so the other processes stop at their next wait or action, as rank threads do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import Tensor

from gpipe_lab.pipeline.errors import PipelineTimeoutError, annotate
from gpipe_lab.pipeline.processes.wire import recv_values, send_values
from gpipe_lab.pipeline.schedules import Action, MessageKey, Schedule
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.channel import RankDevices, Values
from gpipe_lab.pipeline.step.mailbox import Mailbox


class StageStopped(RuntimeError):
    """This process stopped its step because another stage process failed."""


class StageProcessLost(RuntimeError):
    """A stage process ended (or its pipe broke) while a step needed it."""


class StageProcessEnded(StageProcessLost):
    """A stage process ended, or stopped answering: its exit code, as its parent saw it."""


class ProcessChannel:
    """The endpoint of the rank ``rank`` of a pipeline whose ranks each run in a process of their own.

    ``outgoing`` / ``incoming``: a pipe per neighbouring rank; ``abort``: a shared integer
    (``multiprocessing.RawValue``); ``check_peers``: called by every wait, raises when a peer died.
    """

    holds_all_stages = False

    def __init__(self, rank: int, num_ranks: int, outgoing: dict[int, Connection], incoming: dict[int, Connection],
                 abort: Any, threads_per_rank: int | None, timeout: float,
                 check_peers: Callable[[], None] | None = None) -> None:
        self.ranks = [rank]
        self.rank, self.num_ranks = rank, num_ranks
        self.threads_per_rank = threads_per_rank
        self.timeout = timeout
        self.peak_live: dict[int, int] = {}
        self.abort = abort
        self.serial = 0  # the step the next ``open`` begins; set by the process's driver
        self._outgoing = outgoing
        self._send_locks = {k: threading.Lock() for k in outgoing}
        self._check_peers = check_peers
        self._lock = threading.Lock()
        self._mailbox = Mailbox()
        self._open_serial = -1
        self._early: list[tuple[int, MessageKey, tuple[Any, ...]]] = []
        self._lost: tuple[int, BaseException] | None = None
        for src, conn in incoming.items():
            threading.Thread(target=self._receive, args=(src, conn), name=f"gpipe-pipe-from-{src}",
                             daemon=True).start()

    # ------------------------------------------------------------ receiving
    def _receive(self, src: int, conn: Connection) -> None:
        try:
            while True:
                (serial, key), values, was_tensor = recv_values(conn)
                with self._lock:
                    if serial == self._open_serial:
                        self._mailbox.put(key, (values, was_tensor))
                    elif serial > self._open_serial:
                        self._early.append((serial, key, (values, was_tensor)))
        except (EOFError, OSError) as exc:  # the sender ended: what it did not send never comes
            with self._lock:
                self._lost = (src, exc)
                self._mailbox.break_link(src, exc)

    # ------------------------------------------------------------ the endpoint
    def prepare(self, schedule: Schedule) -> Any:
        return None

    def open(self, prepared: Any, mailbox: Mailbox, ranks: RankDevices) -> None:
        with self._lock:
            self._mailbox, self._open_serial = mailbox, self.serial
            early, self._early = self._early, []
            for serial, key, item in early:
                if serial == self.serial:
                    mailbox.put(key, item)
                elif serial > self.serial:
                    self._early.append((serial, key, item))
            if self._lost is not None:
                mailbox.break_link(*self._lost)

    def rank_context(self, rank: int, device: torch.device) -> AbstractContextManager[Any]:
        return nullcontext()

    def send(self, key: MessageKey, values: Values, was_tensor: bool, sender: StageRuntime) -> None:
        dst = key[1] % self.num_ranks
        if dst == self.rank:  # a chunk of this same rank (virtual stages)
            self._mailbox.put(key, (values, was_tensor))
            return
        try:
            with self._send_locks[dst]:
                send_values(self._outgoing[dst], (self.serial, key), values, was_tensor)
        except OSError as exc:
            raise StageProcessLost(f"the stage process of rank {dst} is gone ({exc}); sending {key}") from None

    def receive(self, item: tuple[Any, ...], receiver: StageRuntime) -> tuple[Values, bool]:
        return item[0], item[1]

    def poll(self) -> None:
        failed = self.abort.value
        if failed and failed - 1 != self.rank:
            raise StageStopped(f"rank {self.rank} stopped because the stage process of rank {failed - 1} failed")
        if self._check_peers is not None:
            self._check_peers()

    def timed_out(self, key: MessageKey, action: Action, peer: int, done: Sequence[Action | None],
                  waiting: Sequence[Action | None]) -> PipelineTimeoutError:
        return PipelineTimeoutError(self.timeout, done, waiting,
                                    f"rank {self.rank} waited for {key} from the stage process of rank {peer}")

    def undelivered(self, key: MessageKey, action: Action, peer: int, cause: BaseException) -> BaseException:
        return StageProcessLost(f"the stage process of rank {peer} ended before sending {key} ({cause!r})")

    def stage_done(self, runtime: StageRuntime) -> bool:
        return False  # the caller's process checks every stage once the gradients are back

    def close(self, ranks: RankDevices, ok: bool, sync_gradients: bool) -> None:
        return None  # sends are synchronous: nothing is in flight after the last action

    def fail(self, exc: BaseException, stage: int, action: Action | None) -> BaseException:
        if not self.abort.value:
            self.abort.value = self.rank + 1  # every other process stops at its next wait
        return annotate(exc, stage, action) if isinstance(exc, Exception) else exc

    def announce(self, exc: BaseException, stage: int, action: Action | None) -> None:
        return None  # ``fail`` raises the shared flag, once this process's rank thread has ended

    def share(self, vector: Tensor) -> Tensor:
        return vector  # the caller's process judges the step once every gradient is back

    def fail_early(self, exc: BaseException) -> None:
        return None

"""One step's shared state: what the executor derives from a schedule once (``ExecutionPlan``), and
the state its rank threads share while the step runs (``StepState``: mailbox, progress, failures,
cancellation, leaving autocast together).

The executor (``executor.py``) walks the actions; this file holds no walking, only the state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from gpipe_lab.pipeline.errors import PipelineTimeoutError
from gpipe_lab.pipeline.schedules import (
    Action,
    MessageKey,
    Schedule,
    expected_messages,
    incoming,
    outgoing,
    placement_of,
)
from gpipe_lab.pipeline.stage.checkpointing import autocast_state
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.channel import StepFeed
from gpipe_lab.pipeline.step.mailbox import Mailbox

Failure = tuple[float, int, "Action | None", BaseException]  # (when, rank, action, exception)
# per action of a rank, its program line: (action, its stage's runtime, the message it takes, the
# message it sends, its stage's last B/W, the rank's next action)
PlannedAction = tuple[Action, StageRuntime, "MessageKey | None", "MessageKey | None", bool, "Action | None"]


class ExecutionPlan:
    """What the executor derives from one schedule, once: per rank its program (every action with
    what the walk would otherwise look up per action), and the rank that sends each message."""

    def __init__(self, schedule: Schedule, num_stages: int, runtimes: Mapping[int, StageRuntime]) -> None:
        placement = placement_of(schedule, num_stages)  # the rank of each stage, read from the lists
        self.schedule = schedule  # held, so that the cache's key (its id) is not reused
        self.ranks: list[list[PlannedAction]] = []
        self.senders: dict[MessageKey, int] = {}
        for actions in schedule:
            last = {a.stage: i for i, a in enumerate(actions) if a.kind in "BW"}
            following: list[Action | None] = [*actions[1:], None]
            # a rank this process does not host has no runtimes here: its program is never walked
            self.ranks.append([(a, runtimes[a.stage], incoming(a, num_stages), outgoing(a, num_stages),
                                last.get(a.stage) == i, following[i]) for i, a in enumerate(actions)]
                              if all(a.stage in runtimes for a in actions) else [])
            self.senders.update(expected_messages(actions, placement, num_stages))


class Stalled(Exception):
    """The caller's wait saw no rank progress for a whole timeout (``error`` says where each was)."""

    def __init__(self, error: PipelineTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


class StepState:
    """The state of one step shared by its rank threads."""

    def __init__(self, plan: ExecutionPlan, feed: StepFeed, sync_gradients: bool) -> None:
        schedule = plan.schedule
        K = len(schedule)
        self.plan, self.schedule, self.feed, self.sync_gradients = plan, schedule, feed, sync_gradients
        self.mailbox = Mailbox()
        self.done: list[Action | None] = [None] * K
        self.current: list[Action | None] = [actions[0] if actions else None for actions in schedule]
        self.senders = plan.senders
        self.failures: list[Failure] = []
        self.progress = 0  # actions and waits ended, by every rank: the caller's sign of life
        self.waiting = [False] * K  # rank k is in a mailbox wait (bounded on its own)
        self.running = [threading.Event() for _ in range(K)]
        self.starting = threading.Lock()  # a rank task begins, or the step is cancelled: not both
        self.cancelled = False
        self.finished = [threading.Event() for _ in range(K)]
        self.autocast = autocast_state()  # autocast is per thread: the stage threads take the caller's
        # torch keeps one weight-cast cache per process and clears it when any thread leaves its
        # outermost autocast region: under autocast the rank threads leave together, so a rank
        # that ends early does not make the others cast every weight again
        self.leaving: threading.Barrier | None = None  # set by ``hosting``

    def hosting(self, num_threads: int) -> None:
        """The step runs ``num_threads`` rank threads in this process."""
        if num_threads > 1 and any(on for _, on, _ in self.autocast[0]):
            self.leaving = threading.Barrier(num_threads)

    def fail(self, rank: int, exc: BaseException) -> None:
        self.failures.append((time.monotonic(), rank, self.current[rank], exc))
        self.mailbox.stop()
        if self.leaving is not None:
            self.leaving.abort()

    def cancel(self) -> None:
        """The caller was interrupted: running ranks stop at their next action or wait, and a
        rank task that has not begun yet (or is still queued) returns without running."""
        self.mailbox.stop()
        with self.starting:
            self.cancelled = True
        if self.leaving is not None:
            self.leaving.abort()

    def begin(self, rank: int) -> bool:
        """Rank ``rank``'s task starts: False when the step was cancelled before it did."""
        with self.starting:
            if self.cancelled:
                return False
            self.running[rank].set()
            return True

    def leave_together(self, timeout: float) -> None:
        """Wait (bounded) for every rank thread to end its walk before leaving autocast."""
        if self.leaving is not None:
            try:
                self.leaving.wait(timeout)
            except threading.BrokenBarrierError:
                pass  # a rank failed, or the wait ran out: nothing to keep open for

    def first_failure(self) -> Failure:
        """The earliest failure that is not a wait that gave up (those follow from it)."""
        real = [f for f in self.failures if not isinstance(f[3], TimeoutError)]
        return min(real or self.failures, key=lambda f: f[0])

"""Local transport: one process, every pipeline rank on a thread of its own (``executor``).

A send puts the value straight into the step's mailbox, with a mark of the
sender's compute stream; a receive orders the receiver's streams after it and
copies to the receiver's device (``streams``). On CPU devices every rank's
thread runs with its own share of the cores, and because the backward of each
stage is explicit, stages compute in parallel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from gpipe_lab.pipeline.devices.streams import NoStreams, Streams, streams_for
from gpipe_lab.pipeline.errors import PipelineTimeoutError, annotate
from gpipe_lab.pipeline.schedules import Action, MessageKey, Schedule
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.channel import RankDevices, Values
from gpipe_lab.pipeline.step.mailbox import Mailbox


class LocalChannel:
    """The endpoint of every rank of one process (see ``channel.Endpoint``)."""

    holds_all_stages = True

    def __init__(self, runtimes: Mapping[int, StageRuntime], placement: Sequence[int],
                 threads_per_stage: int | None, timeout: float) -> None:
        self.num_ranks = max(placement) + 1
        self.ranks = list(range(self.num_ranks))
        self.rank_of = tuple(placement)  # the rank holding each stage: its streams are that rank's
        self.threads_per_rank = threads_per_stage
        self.timeout = timeout
        self.streams: Streams = streams_for([r.device for r in runtimes.values()])
        self._mailbox = Mailbox()
        self.peak_live: dict[int, int] = {}

    def prepare(self, schedule: Schedule) -> Any:
        return None

    def open(self, prepared: Any, mailbox: Mailbox, ranks: RankDevices) -> None:
        self._mailbox = mailbox
        self.streams.begin(ranks)  # the optimizer updated the parameters on the caller's stream

    def rank_context(self, rank: int, device: torch.device) -> AbstractContextManager[Any]:
        return self.streams.compute(rank, device)

    def send(self, key: MessageKey, values: Values, was_tensor: bool, sender: StageRuntime) -> None:
        streams = self.streams
        mark = None if type(streams) is NoStreams else streams.mark(self.rank_of[sender.index], sender.device)
        self._mailbox.put(key, (values, was_tensor, mark, sender.device))

    def receive(self, item: tuple[Any, ...], receiver: StageRuntime) -> tuple[Values, bool]:
        values, was_tensor, mark, source = item
        if type(self.streams) is NoStreams and source == receiver.device:
            return values, was_tensor  # already where they are used: nothing to copy or order
        values = self.streams.hand_over(values, mark, self.rank_of[receiver.index], receiver.device)
        return values, was_tensor

    def poll(self) -> None:
        return None

    def timed_out(self, key: MessageKey, action: Action, peer: int, done: Sequence[Action | None],
                  waiting: Sequence[Action | None]) -> PipelineTimeoutError:
        return PipelineTimeoutError(self.timeout, done, waiting)

    def undelivered(self, key: MessageKey, action: Action, peer: int, cause: BaseException) -> BaseException:
        return cause  # threads hand over directly: nothing is delivered that could fail

    def stage_done(self, runtime: StageRuntime) -> bool:
        return True  # no replicas: nothing to synchronize

    def close(self, ranks: RankDevices, ok: bool, sync_gradients: bool) -> None:
        self.streams.finish(ranks)  # the caller reads losses and gradients on its own stream

    def fail(self, exc: BaseException, stage: int, action: Action | None) -> BaseException:
        # an interrupt (KeyboardInterrupt, SystemExit) reaches the caller as it was raised
        return annotate(exc, stage, action) if isinstance(exc, Exception) else exc

    def announce(self, exc: BaseException, stage: int, action: Action | None) -> None:
        return None  # every rank is a thread of this process: the stopped mailbox tells them

    def share(self, vector: Tensor) -> Tensor:
        return vector

    def fail_early(self, exc: BaseException) -> None:
        return None

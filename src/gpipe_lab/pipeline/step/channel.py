"""The transport interface (an endpoint) and the body of one action, shared by both transports.

The engine core runs a step through the one executor (``executor.Executor``),
which walks each hosted rank's action list and takes every incoming value from
one keyed mailbox (``mailbox.Mailbox``). A transport is only an *endpoint*: it
sends a value to the stage that consumes it (``send``), turns a delivered item
into values the receiving rank can use (``receive``), and sums a vector over
every rank (``share``). ``local_channel.LocalChannel`` hands values over between
threads; ``distributed.p2p_channel.P2PChannel`` over torch.distributed.

What an action does (``run_action``), the same in both transports:

* ``F``: the first stage reads its micro-batch, others receive the activation;
  compute; send the output to the next stage (at micro-batch 0, its signature checked
  against earlier steps': ``stage.boundary``);
* ``B``: re-materialize (overlapping the wait), receive the output gradient (the
  last stage has its loss, or the caller's gradient in ``pipe(x).backward()``);
  compute; send the input gradient to the previous stage;
* ``W``: the deferred weight gradients.

A stage that long skips cross (``runtime.skips``) also receives its popped skip tensors in ``F``
and their gradients' return in ``B``, each straight from or to the other stage (``skip.transport``).

Which message an action consumes and produces comes from the schedule walker's
one dependency rule (``schedules.incoming`` / ``schedules.outgoing``), applied once
per schedule by the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from gpipe_lab.pipeline.devices.assignment import move_target
from gpipe_lab.pipeline.errors import PipelineTimeoutError
from gpipe_lab.pipeline.microbatch import to_device
from gpipe_lab.pipeline.schedules import Action, MessageKey, Schedule
from gpipe_lab.pipeline.skip.transport import (
    receive_skip_gradients,
    receive_skips,
    send_skip_gradients,
    send_skips,
)
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.mailbox import Mailbox

Values = tuple[Tensor | None, ...]
RankDevices = Sequence[tuple[int, torch.device]]


@dataclass
class StepFeed:
    """What a step reads from outside the pipeline, per micro-batch."""

    #: the first stage's inputs (``None`` on ranks without the first stage)
    inputs: Sequence[tuple[Tensor, ...]] | None
    input_was_tensor: bool
    #: the last stage's targets (``None``: no loss inside the pipeline)
    targets: Sequence[object] | None = None
    #: the gradient of the last stage's outputs, given by the caller (``pipe(x).backward()``)
    output_grads: Sequence[Values] | None = None


class Endpoint(Protocol):
    """A transport, as the executor drives it. One step at a time; ``open`` begins one."""

    #: pipeline ranks whose action lists run in this process
    ranks: list[int]
    #: True when every stage is in this process (the loss is whole here)
    holds_all_stages: bool
    #: seconds one wait may last (mailbox, sends, collectives); settable between steps
    timeout: float
    #: intra-op threads of a CPU rank's thread (``None``: the process's setting)
    threads_per_rank: int | None
    #: per hosted stage, the most micro-batches it held at once in the last step (the executor's count)
    peak_live: dict[int, int]

    def prepare(self, schedule: Schedule) -> Any:
        """Whatever the endpoint derives once per schedule (the core caches it)."""

    def open(self, prepared: Any, mailbox: Mailbox, ranks: RankDevices) -> None:
        """Begin a step: deliver the values sent to the hosted ranks into ``mailbox``."""

    def rank_context(self, rank: int, device: torch.device) -> AbstractContextManager[Any]:
        """Entered by a rank's thread around its whole list (e.g. its compute stream)."""

    def send(self, key: MessageKey, values: Values, was_tensor: bool, sender: StageRuntime) -> None:
        """Start handing ``values`` to the stage named in ``key``."""

    def receive(self, item: tuple[Any, ...], receiver: StageRuntime) -> tuple[Values, bool]:
        """The values of a mailbox item, ready for ``receiver``'s device and stream."""

    def poll(self) -> None:
        """Called before each action and while a rank waits; raises if another process stopped the step."""

    def timed_out(self, key: MessageKey, action: Action, peer: int, done: Sequence[Action | None],
                  waiting: Sequence[Action | None]) -> PipelineTimeoutError:
        """The error of a wait for ``key`` (sent by rank ``peer``) that reached the timeout."""

    def undelivered(self, key: MessageKey, action: Action, peer: int, cause: BaseException) -> BaseException:
        """The error of a wait for ``key`` whose delivery from rank ``peer`` failed."""

    def stage_done(self, runtime: StageRuntime) -> bool:
        """A stage ran its last backward of a step that synchronizes gradients; True when its
        gradients are final now (no data-parallel all-reduce still to end in ``close``)."""

    def close(self, ranks: RankDevices, ok: bool, sync_gradients: bool) -> None:
        """End the step: with ``ok`` wait for what is in flight; else only drop it (never raises)."""

    def fail(self, exc: BaseException, stage: int, action: Action | None) -> BaseException:
        """The error to raise for ``exc`` (annotated with where it happened; announced to other ranks)."""

    def announce(self, exc: BaseException, stage: int, action: Action | None) -> None:
        """An action's ``exc``, on the failing rank's thread as it is raised: tell other processes
        now (``fail`` follows once this process's rank threads have ended, with the same ``exc``)."""

    def share(self, vector: Tensor) -> Tensor:
        """``vector`` summed over every rank of every replica (identity when all is local)."""

    def fail_early(self, exc: BaseException) -> None:
        """Tell the other ranks that this one fails before its first action."""


Receive = Callable[[MessageKey, Action], tuple[Values, bool]]


def run_action(action: Action, runtime: StageRuntime, receive: Receive, endpoint: Endpoint, feed: StepFeed,
               key: MessageKey | None, out: MessageKey | None) -> None:
    """One F, B or W of one stage (see the module docstring); ``receive`` waits for a message.

    ``key`` / ``out``: the message the action consumes / produces (``schedules.incoming`` /
    ``schedules.outgoing``, derived once per schedule by the executor).

    Raises:
        ValueError: the first stage got no inputs.
    """
    mb = action.microbatch
    kind = action.kind
    skips = runtime.skips  # long skips go straight between their two stages (``skip.transport``)
    values: Values
    if kind == "F":
        if key is None:
            if feed.inputs is None:
                raise ValueError("this rank runs the first stage but got no inputs")
            values, was_tensor = to_device(feed.inputs[mb], runtime.device), feed.input_was_tensor
        else:
            values, was_tensor = receive(key, action)
        if skips is not None:
            values += receive_skips(skips, action, receive)
        target = (move_target(feed.targets[mb], runtime.device)
                  if feed.targets is not None and out is None else None)
        # an activation holds no None (only gradients do)
        outputs, out_tensor = runtime.forward(mb, cast("tuple[Tensor, ...]", values), was_tensor, target)
        sent: Values = outputs
        if skips is not None:
            sent = send_skips(skips, mb, outputs, lambda k, v: endpoint.send(k, v, False, runtime))
        if out is not None:
            if mb == 0:  # once per step and boundary (``stage.boundary``)
                runtime.boundary.check(values, sent, runtime.mode)
            endpoint.send(out, sent, out_tensor, runtime)
    elif kind == "B":
        runtime.rematerialize(mb)  # overlaps the wait for the gradient
        grads: Values | None = None
        if key is not None:
            grads = receive(key, action)[0]
        elif feed.output_grads is not None:
            grads = tuple(None if g is None else g.to(runtime.device) for g in feed.output_grads[mb])
        if skips is not None and skips.outbound:
            grads = (grads or ()) + receive_skip_gradients(skips, action, receive)
        grads_in = runtime.backward(mb, grads)
        if skips is not None:
            grads_in = send_skip_gradients(skips, mb, grads_in, lambda k, v: endpoint.send(k, v, False, runtime))
        if out is not None:
            endpoint.send(out, grads_in, False, runtime)
    else:
        runtime.weight_backward(mb)

"""How the engine core talks to a stage's neighbours, and the one walk of a rank's actions.

A *channel* moves boundary values between stages; the core never knows whether
they cross threads (``local.LocalChannel``) or processes
(``distributed.p2p_channel.P2PChannel``). A channel runs the action lists of the
pipeline ranks it hosts (every rank locally, its own under torch.distributed),
each through ``run_actions``, so an action does the same thing in both transports:

* ``F``: the first stage reads its micro-batch, others receive the activation;
  compute; send the output to the next stage;
* ``B``: re-materialize (overlapping the wait), receive the output gradient (the
  last stage has its loss, or the caller's gradient in ``pipe(x).backward()``);
  compute; send the input gradient to the previous stage;
* ``W``: the deferred weight gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from gpipe_lab.pipeline.devices import move_target
from gpipe_lab.pipeline.microbatch import to_device
from gpipe_lab.pipeline.schedules import Action, Schedule
from gpipe_lab.pipeline.stage import StageRuntime

Values = tuple[Tensor | None, ...]
MessageKey = tuple[str, int, int]  # ("F" activation | "B" gradient, destination stage, micro-batch)


def incoming(action: Action, num_stages: int) -> MessageKey | None:
    """The message an action consumes (None: it reads local data)."""
    if action.kind == "F" and action.stage > 0:
        return ("F", action.stage, action.microbatch)
    if action.kind == "B" and action.stage < num_stages - 1:
        return ("B", action.stage, action.microbatch)
    return None


def outgoing(action: Action, num_stages: int) -> MessageKey | None:
    """The message an action produces (None: the end of the pipeline)."""
    if action.kind == "F" and action.stage < num_stages - 1:
        return ("F", action.stage + 1, action.microbatch)
    if action.kind == "B" and action.stage > 0:
        return ("B", action.stage - 1, action.microbatch)
    return None


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
    """One rank's side of a channel during a step."""

    def receive(self, key: MessageKey, action: Action) -> tuple[Values, bool]:
        """The value ``key`` for ``action`` (blocking; the wait is the channel's to record)."""

    def send(self, key: MessageKey, values: Values, was_tensor: bool) -> None:
        """Hand ``values`` to the stage named in ``key``."""


class Channel(Protocol):
    """The transport under the engine core."""

    #: pipeline ranks whose action lists this channel runs in this process
    ranks: list[int]
    #: True when every stage is in this process (the loss is whole here)
    holds_all_stages: bool

    def prepare(self, schedule: Schedule) -> Any:
        """Whatever the channel derives once per schedule (the core caches it)."""

    def run(self, schedule: Schedule, prepared: Any, feed: StepFeed, sync_gradients: bool) -> None:
        """Run the hosted ranks' lists; raise the first failure, annotated, after stopping."""

    def share(self, vector: Tensor) -> Tensor:
        """``vector`` summed over every rank of every replica (identity when all is local)."""

    def fail_early(self, exc: BaseException) -> None:
        """Tell the other ranks that this one fails before its first action."""


def run_actions(actions: Sequence[Action], runtimes: Mapping[int, StageRuntime], endpoint: Endpoint,
                feed: StepFeed, num_stages: int,
                after: Callable[[int, Action], None] | None = None) -> None:
    """Run one rank's actions in order; ``after(i, action)`` follows each one.

    Raises:
        ValueError: the first stage got no inputs.
        Exception: what a layer or the channel raised (the caller annotates it).
    """
    for i, action in enumerate(actions):
        run_action(action, runtimes[action.stage], endpoint, feed, num_stages)
        if after is not None:
            after(i, action)


def run_action(action: Action, runtime: StageRuntime, endpoint: Endpoint, feed: StepFeed,
               num_stages: int) -> None:
    """One F, B or W of one stage (see the module docstring).

    Raises:
        ValueError: the first stage got no inputs.
    """
    mb = action.microbatch
    key = incoming(action, num_stages)
    if action.kind == "F":
        if key is None:
            if feed.inputs is None:
                raise ValueError("this rank runs the first stage but got no inputs")
            values, was_tensor = to_device(feed.inputs[mb], runtime.device), feed.input_was_tensor
        else:
            values, was_tensor = endpoint.receive(key, action)
        target = (move_target(feed.targets[mb], runtime.device)
                  if feed.targets is not None and runtime.is_last else None)
        outputs, out_tensor = runtime.forward(mb, values, was_tensor, target)
        out = outgoing(action, num_stages)
        if out is not None:
            endpoint.send(out, outputs, out_tensor)
    elif action.kind == "B":
        runtime.rematerialize(mb)  # overlaps the wait for the gradient
        grads: Values | None = None
        if key is not None:
            grads = endpoint.receive(key, action)[0]
        elif feed.output_grads is not None:
            grads = tuple(None if g is None else g.to(runtime.device) for g in feed.output_grads[mb])
        grads_in = runtime.backward(mb, grads)
        out = outgoing(action, num_stages)
        if out is not None:
            endpoint.send(out, grads_in, False)
    else:
        runtime.weight_backward(mb)

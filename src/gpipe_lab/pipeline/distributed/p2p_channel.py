"""The torch.distributed channel: this rank's action list over point-to-point messages.

The same ``channel.run_actions`` as the local channel computes each action;
this file only moves tensors. Per step:

1. receiver threads post every incoming receive of the step ahead of need
   (``links.start_receivers``);
2. for each action: take its input from the inbox (time blocked there is a
   ``wait`` event), compute, start an asynchronous send of the result, keeping
   its ``Work`` until completion;
3. right after a chunk's last backward action, its data-parallel all-reduce
   starts (``GradientSync``), overlapping the remaining actions;
4. wait for the sends and the all-reduces.

Any exception is annotated with rank, stage and action, written to the abort
channel so that every rank stops, and re-raised.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe_lab.pipeline.channel import StepFeed, Values, run_actions
from gpipe_lab.pipeline.distributed.failure import AbortChannel, PeerFailedError, wait_works
from gpipe_lab.pipeline.distributed.grad_sync import GradientSync
from gpipe_lab.pipeline.distributed.links import (
    Inbox,
    LinkKey,
    MessageKey,
    accept,
    message_plan,
    start_receivers,
)
from gpipe_lab.pipeline.distributed.topology import Topology
from gpipe_lab.pipeline.distributed.wire import Pending, send_values
from gpipe_lab.pipeline.errors import annotate, describe
from gpipe_lab.pipeline.schedules import Action, Schedule
from gpipe_lab.pipeline.stage import StageRuntime
from gpipe_lab.pipeline.timeline import Event


class _Endpoint:
    """This rank's sends and receives during one step."""

    def __init__(self, channel: P2PChannel, inbox: Inbox) -> None:
        self.channel, self.inbox = channel, inbox
        self.seq: dict[LinkKey, int] = {}
        self.pending: Pending = []

    def receive(self, key: MessageKey, action: Action) -> tuple[Values, bool]:
        topo = self.channel.topo
        src_stage = action.stage - 1 if key[0] == "F" else action.stage + 1
        start = time.perf_counter()
        values, was_tensor, ready = self.inbox.get(key, topo.rank_of(src_stage), self.channel.timeout,
                                                   self.channel.abort)
        values = accept(values, ready, self.channel.device)
        self.channel.runtimes[action.stage].events.append(
            Event(action.stage, "wait", action.microbatch, start, time.perf_counter()))
        return values, was_tensor

    def send(self, key: MessageKey, values: Values, was_tensor: bool) -> None:
        topo = self.channel.topo
        dst = topo.rank_of(key[1])
        if dst == topo.rank:
            self.inbox.put(key, (values, was_tensor, None))
            return
        link = ("act" if key[0] == "F" else "grad", topo.rank, dst)
        n = self.seq.get(link, 0)
        self.seq[link] = n + 1
        self.pending.extend(send_values(values, was_tensor, dst, topo.links[link], n, self.channel.header_device,
                                        topo.header_links.get(link)))


class P2PChannel:
    """Runs this rank's actions for the virtual stages it holds, over torch.distributed."""

    holds_all_stages = False

    def __init__(self, topo: Topology, runtimes: dict[int, StageRuntime], device: torch.device,
                 abort: AbortChannel, timeout: float, grad_sync: GradientSync) -> None:
        self.topo = topo
        self.runtimes = runtimes
        self.device = device
        # headers are CPU tensors: under NCCL they travel on the links' gloo groups
        self.header_device = torch.device("cpu")
        self.abort = abort
        self.timeout = timeout
        self.grad_sync = grad_sync
        self.ranks = [topo.stage_index]
        self.num_virtual = topo.num_stages * topo.virtual_stages
        self.peak_live: dict[int, int] = {}

    def prepare(self, schedule: Schedule) -> Any:
        """The ordered messages of every link (checked once per schedule)."""
        return message_plan(schedule, self.topo.pp_ranks, self.num_virtual)

    def share(self, vector: Tensor) -> Tensor:
        """Sum over every rank of the job (the loss share and the non-finite verdict)."""
        wait_works([dist.all_reduce(vector, async_op=True)], "sharing the loss", None, self.timeout, self.abort)
        return vector

    def fail_early(self, exc: BaseException) -> None:
        self.abort.signal(f"rank {self.topo.rank} failed before its first action: {exc}")

    def run(self, schedule: Schedule, prepared: Any, feed: StepFeed, sync_gradients: bool) -> None:
        """Execute this rank's list of ``schedule``.

        Raises:
            Exception: what a layer raised, annotated with rank, stage and micro-batch.
            PeerFailedError: another rank failed or became unreachable.
            PeerTimeoutError: a peer did not answer within the timeout.
        """
        actions = schedule[self.topo.stage_index]
        inbox = Inbox()
        device = self.device
        start_receivers(prepared, self.topo.rank, self.topo.links, inbox, device, self.header_device,
                        (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None,
                        self.topo.header_links)
        endpoint = _Endpoint(self, inbox)
        last_backward = {a.stage: i for i, a in enumerate(actions) if a.kind in "BW"}
        self.peak_live = {s: 0 for s in self.runtimes}
        current: list[Action | None] = [actions[0] if actions else None]

        def after(i: int, action: Action) -> None:
            runtime = self.runtimes[action.stage]
            self.peak_live[action.stage] = max(self.peak_live[action.stage], len(runtime._saved))
            if sync_gradients and last_backward.get(action.stage) == i:
                self.grad_sync.start(runtime.module.parameters())
            current[0] = actions[i + 1] if i + 1 < len(actions) else None

        try:
            run_actions(actions, self.runtimes, endpoint, feed, self.num_virtual, after)
            wait_works([w for w, _ in endpoint.pending], "sending activations/gradients", None, self.timeout,
                       self.abort)
            if sync_gradients:
                self.grad_sync.finish()
        except BaseException as exc:
            self.grad_sync.discard()
            for runtime in self.runtimes.values():
                runtime.abort()
            raise self._fail(exc, current[0]) from None

    def _fail(self, exc: BaseException, action: Action | None) -> BaseException:
        rank = self.topo.rank
        stage = self.topo.stage_index if action is None else action.stage
        if isinstance(exc, PeerFailedError):  # a link failed: name who went away, and where this rank was
            exc = self.abort.explain_error(exc, describe(stage, action))
        culprit = getattr(exc, "failed_rank", None)
        if isinstance(exc, PeerFailedError) and str(exc).startswith(f"rank {rank} stopped because"):
            return exc  # another rank's abort: already announced
        if culprit is not None:
            self.abort.signal(f"rank {culprit} failed or stopped answering (seen by rank {rank} "
                              f"in {describe(stage, action)}): {exc}")
            return exc
        annotate(exc, stage, action)
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"rank {rank}: {exc.args[0]}",) + tuple(exc.args[1:])
        self.abort.signal(f"rank {rank} failed in {describe(stage, action)}: "
                          f"{type(exc).__name__}: {exc}")
        return exc

"""The torch.distributed endpoint: this rank's messages over point-to-point links.

The executor (``executor.Executor``) runs this rank's list as it runs every
rank's locally; this file only moves tensors. Per step:

1. receiver threads post every incoming receive of the step ahead of need and
   put each value into the step's mailbox (``links.start_receivers``);
2. a send starts an asynchronous send, whose ``Work`` and tensor are dropped as
   soon as it completes (``sends.InFlightSends``); a value for a chunk of this
   same rank goes straight into the mailbox;
3. during the backward of a chunk's last micro-batch, each gradient bucket's
   data-parallel all-reduce starts as soon as the bucket is complete, the rest
   right after the chunk's last backward action (``GradientSync``);
4. ``close`` waits for the sends and the all-reduces.

Every wait polls the abort channel; an error is annotated with rank, stage and
action and written to the abort channel so that every rank stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe_lab.pipeline.distributed.failure import AbortChannel, PeerFailedError, PeerTimeoutError, wait_works
from gpipe_lab.pipeline.distributed.grad_sync import GradientSync
from gpipe_lab.pipeline.distributed.links import LinkKey, LinkStreams, accept, message_plan, start_receivers
from gpipe_lab.pipeline.distributed.sends import InFlightSends
from gpipe_lab.pipeline.distributed.topology import Topology
from gpipe_lab.pipeline.distributed.wire import send_values
from gpipe_lab.pipeline.errors import annotate, describe
from gpipe_lab.pipeline.schedules import Action, MessageKey, Schedule
from gpipe_lab.pipeline.skip.layout import SkipLayout
from gpipe_lab.pipeline.skip.transport import link_kind, message_name, skip_link_plan
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.channel import RankDevices, Values
from gpipe_lab.pipeline.step.mailbox import Mailbox


class P2PChannel:
    """The endpoint of this rank, for the virtual stages it holds (see ``channel.Endpoint``)."""

    holds_all_stages = False
    threads_per_rank: int | None = None  # the process's intra-op threads, as a local stage of the same share

    def __init__(self, topo: Topology, runtimes: dict[int, StageRuntime], device: torch.device,
                 abort: AbortChannel, timeout: float, grad_sync: GradientSync,
                 skips: SkipLayout | None = None) -> None:
        self.topo = topo
        self.skips = skips  # the model's long skips: their messages join the links' plan
        self.device = device
        # headers are CPU tensors: under NCCL they travel on the links' gloo groups
        self.header_device = torch.device("cpu")
        self.abort = abort
        self.grad_sync = grad_sync
        self.timeout = timeout
        self.ranks = [topo.stage_index]
        self.num_virtual = topo.num_stages * topo.virtual_stages
        self._mailbox = Mailbox()
        self.peak_live: dict[int, int] = {}
        self._seq: dict[LinkKey, int] = {}
        self.runtimes = runtimes
        #: one receive stream per incoming link, for the channel's lifetime
        self.link_streams = LinkStreams(device)
        self.sends = InFlightSends()
        self._announced: BaseException | None = None  # this step's exception ``announce`` announced

    @property
    def timeout(self) -> float:
        """Seconds one wait may last: receives, sends, the loss sharing and the gradient all-reduce."""
        return self.grad_sync.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.grad_sync.timeout = float(seconds)

    def prepare(self, schedule: Schedule) -> Any:
        """The ordered messages of every link (checked once per schedule), and per local chunk
        how many backward accumulations complete its gradients (0 when ``W`` actions make them)."""
        mine = schedule[self.topo.stage_index]
        accumulations = {}
        for j in self.runtimes:
            kinds = [a.kind for a in mine if a.stage == j]
            accumulations[j] = 0 if "W" in kinds else kinds.count("B")
        plan = message_plan(schedule, self.topo.pp_ranks, self.num_virtual)
        plan.update(skip_link_plan(schedule, self.skips, self.topo.pp_ranks))
        return plan, accumulations

    def open(self, prepared: Any, mailbox: Mailbox, ranks: RankDevices) -> None:
        plan, accumulations = prepared
        self.abort.refuse_reuse("train_step() / pipe(x)")
        self._mailbox, self._seq, self.sends = mailbox, {}, InFlightSends()
        self._announced = None
        for j, runtime in self.runtimes.items():
            self.grad_sync.arm(j, list(runtime.module.parameters()), accumulations[j])
        device = self.device
        start_receivers(plan, self.topo.rank, self.topo.links, mailbox, device, self.header_device,
                        (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None,
                        self.topo.header_links, self.link_streams)

    def rank_context(self, rank: int, device: torch.device) -> AbstractContextManager[Any]:
        return nullcontext()

    def send(self, key: MessageKey, values: Values, was_tensor: bool, sender: StageRuntime) -> None:
        topo = self.topo
        dst = topo.rank_of(key[1])
        if dst == topo.rank:
            self._mailbox.put(key, (values, was_tensor, None))
            return
        link = (link_kind(key), topo.rank, dst)
        n = self._seq.get(link, 0)
        self._seq[link] = n + 1
        self.sends.add(send_values(values, was_tensor, dst, topo.links[link], n, self.header_device,
                                   topo.header_links.get(link)))

    def receive(self, item: tuple[Any, ...], receiver: StageRuntime) -> tuple[Values, bool]:
        values, was_tensor, ready = item
        return accept(values, ready, self.device), was_tensor

    def poll(self) -> None:
        self.abort.check()

    def timed_out(self, key: MessageKey, action: Action, peer: int, done: Sequence[Action | None],
                  waiting: Sequence[Action | None]) -> PeerTimeoutError:
        what = message_name(key)
        src = self.topo.pp_ranks[peer]
        error = PeerTimeoutError(
            f"rank {self.abort.rank} waited more than {self.timeout:g} s for the {what} of micro-batch "
            f"{key[2]} from rank {src}; is rank {src} alive? [in {describe(action.stage, action)}]",
            src, self.timeout)
        error.done, error.waiting = list(done), list(waiting)
        return error

    def undelivered(self, key: MessageKey, action: Action, peer: int, cause: BaseException) -> BaseException:
        what = message_name(key)
        return self.abort.explain(f"receiving the {what} of micro-batch {key[2]} from rank {peer}", [peer],
                                  cause, describe(action.stage, action))

    def stage_done(self, runtime: StageRuntime) -> bool:
        self.grad_sync.start(runtime.module.parameters())
        return self.grad_sync.size == 1  # else final once ``finish`` has averaged them, in ``close``

    def close(self, ranks: RankDevices, ok: bool, sync_gradients: bool) -> None:
        if not ok:
            self.sends.discard()
            self.grad_sync.discard()
            return
        self.sends.close(self.timeout, self.abort)
        if sync_gradients:
            self.grad_sync.finish()

    def share(self, vector: Tensor) -> Tensor:
        """Sum over every rank of the job (the loss share and the non-finite verdict)."""
        wait_works([dist.all_reduce(vector, async_op=True)], "sharing the loss", None, self.timeout, self.abort)
        return vector

    def fail_early(self, exc: BaseException) -> None:
        self.abort.signal(f"rank {self.topo.rank} failed before its first action: {exc}")

    def announce(self, exc: BaseException, stage: int, action: Action | None) -> None:
        """Announce this rank's own failure at once, from the failing stage's thread (the peers stop
        at their next action, not when this rank's threads have ended); ``fail`` then raises it as
        announced. A peer's failure or a timeout is left to ``fail``, which names the peer."""
        if not isinstance(exc, PeerFailedError) and getattr(exc, "failed_rank", None) is None:
            self._announced = self._own_failure(exc, stage, action)

    def fail(self, exc: BaseException, stage: int, action: Action | None) -> BaseException:
        """Annotate ``exc`` with rank, stage and action, and announce it to every rank (unless
        ``announce`` did)."""
        announced, self._announced = self._announced, None  # held for this step only
        if exc is announced:
            return exc
        rank = self.topo.rank
        if isinstance(exc, PeerFailedError):  # a link failed: name who went away, and where this rank was
            exc = self.abort.explain_error(exc, describe(stage, action))
        culprit = getattr(exc, "failed_rank", None)
        if isinstance(exc, PeerFailedError) and str(exc).startswith(f"rank {rank} stopped because"):
            return exc  # another rank's abort: already announced
        if culprit is not None:
            self.abort.signal(f"rank {culprit} failed or stopped answering (seen by rank {rank} "
                              f"in {describe(stage, action)}): {exc}")
            return exc
        return self._own_failure(exc, stage, action)

    def _own_failure(self, exc: BaseException, stage: int, action: Action | None) -> BaseException:
        """``exc``, raised by this rank, annotated and announced."""
        rank = self.topo.rank
        annotate(exc, stage, action)
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"rank {rank}: {exc.args[0]}",) + tuple(exc.args[1:])
        self.abort.signal(f"rank {rank} failed in {describe(stage, action)}: "
                          f"{type(exc).__name__}: {exc}")
        return exc

"""One rank's walk through its action list, over torch.distributed.

The same ``StageRuntime`` as the local transport computes each action; this
file only moves tensors. Per step:

1. receiver threads post every incoming receive of the step ahead of need
   (``links.start_receivers``);
2. for each action: take its input from the inbox (time blocked there is a
   ``wait`` event), compute, start an asynchronous send of the result, keeping
   its ``Work`` until completion;
3. right after a chunk's last weight-gradient action, ``on_chunk_done`` starts
   that chunk's data-parallel all-reduce, overlapping the remaining actions;
4. wait for the sends.

Any exception is annotated with rank, stage and action, written to the abort
channel so that every rank stops, and re-raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gpipe_lab.pipeline.distributed.failure import AbortChannel, PeerFailedError, wait_works
from gpipe_lab.pipeline.distributed.links import Inbox, LinkKey, MessageKey, incoming, start_receivers
from gpipe_lab.pipeline.distributed.topology import Topology
from gpipe_lab.pipeline.distributed.wire import Pending, send_values
from gpipe_lab.pipeline.errors import annotate, describe
from gpipe_lab.pipeline.microbatch import to_device
from gpipe_lab.pipeline.schedule import Action
from gpipe_lab.pipeline.stage import StageRuntime
from gpipe_lab.pipeline.timeline import Event


class RankExecutor:
    """Runs one rank's actions for the virtual stages it holds."""

    def __init__(self, topo: Topology, runtimes: dict[int, StageRuntime], device: torch.device,
                 abort: AbortChannel, timeout: float) -> None:
        self.topo = topo
        self.runtimes = runtimes
        self.device = device
        self.header_device = device if device.type == "cuda" else torch.device("cpu")
        self.abort = abort
        self.timeout = timeout
        self.num_virtual = topo.num_stages * topo.virtual_stages
        self.peak_live: dict[int, int] = {}
        self._inbox = Inbox()

    def run(self, actions: Sequence[Action], plan: dict[LinkKey, list[MessageKey]],
            inputs: Sequence[tuple[Tensor, ...]] | None, input_was_tensor: bool,
            targets: Sequence[object] | None, on_chunk_done: Callable[[int], None]) -> None:
        """Execute ``actions``; chunk 0 reads ``inputs``, the last chunk ``targets``.

        Raises:
            Exception: what a layer raised, annotated with rank, stage and micro-batch.
            PeerFailedError: another rank failed or became unreachable.
            PeerTimeoutError: a peer did not answer within the timeout.
        """
        inbox = self._inbox = Inbox()
        device = self.device
        cuda = device.type == "cuda"
        start_receivers(plan, self.topo.rank, self.topo.links, inbox, device, self.header_device,
                        (lambda: torch.cuda.set_device(device)) if cuda else None)
        seq: dict[LinkKey, int] = {}
        pending: Pending = []
        last_weight = {a.stage: i for i, a in enumerate(actions) if a.kind in "BW"}
        self.peak_live = {s: 0 for s in self.runtimes}
        action: Action | None = None
        try:
            for i, action in enumerate(actions):
                self._act(action, inbox, seq, pending, inputs, input_was_tensor, targets)
                runtime = self.runtimes[action.stage]
                self.peak_live[action.stage] = max(self.peak_live[action.stage], len(runtime._saved))
                if last_weight.get(action.stage) == i:
                    on_chunk_done(action.stage)
            action = None
            wait_works([w for w, _ in pending], "sending activations/gradients", None, self.timeout,
                       self.abort)
        except BaseException as exc:
            for runtime in self.runtimes.values():
                runtime.abort()
            raise self._fail(exc, action) from None

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

    def _receive(self, key: MessageKey, action: Action) -> tuple:
        src_stage = action.stage - 1 if key[0] == "F" else action.stage + 1
        start = time.perf_counter()
        values, was_tensor = self._inbox.get(key, self.topo.rank_of(src_stage), self.timeout, self.abort)
        self.runtimes[action.stage].events.append(
            Event(action.stage, "wait", action.microbatch, start, time.perf_counter()))
        return values, was_tensor

    def _send(self, key: MessageKey, values: tuple, was_tensor: bool, seq: dict[LinkKey, int],
              pending: Pending, inbox: Inbox) -> None:
        dst = self.topo.rank_of(key[1])
        if dst == self.topo.rank:
            inbox.put(key, (values, was_tensor))
            return
        link = ("act" if key[0] == "F" else "grad", self.topo.rank, dst)
        n = seq.get(link, 0)
        seq[link] = n + 1
        pending.extend(send_values(values, was_tensor, dst, self.topo.links[link], n, self.header_device))

    def _act(self, action: Action, inbox: Inbox, seq: dict[LinkKey, int], pending: Pending,
             inputs: Sequence[tuple[Tensor, ...]] | None, input_was_tensor: bool,
             targets: Sequence[object] | None) -> None:
        runtime = self.runtimes[action.stage]
        mb = action.microbatch
        key = incoming(action, self.num_virtual)
        if action.kind == "F":
            if key is None:
                if inputs is None:
                    raise ValueError(f"rank {self.topo.rank} runs the first stage but got no inputs")
                values, was_tensor = to_device(inputs[mb], self.device), input_was_tensor
            else:
                values, was_tensor = self._receive(key, action)
            target = None
            if runtime.is_last and runtime.plan.loss_fn is not None:
                if targets is None:
                    raise ValueError(f"rank {self.topo.rank} runs the last stage but got no targets")
                target = targets[mb]
            outputs, out_tensor = runtime.forward(mb, values, was_tensor, target)
            if action.stage < self.num_virtual - 1:
                self._send(("F", action.stage + 1, mb), outputs, out_tensor, seq, pending, inbox)
        elif action.kind == "B":
            runtime.rematerialize(mb)  # overlaps the wait for the gradient
            grads = None if key is None else self._receive(key, action)[0]
            grads_in = runtime.backward(mb, grads)
            if action.stage > 0:
                self._send(("B", action.stage - 1, mb), grads_in, False, seq, pending, inbox)
        else:
            runtime.weight_backward(mb)

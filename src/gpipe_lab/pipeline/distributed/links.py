"""Who sends what to whom, and the receiver threads that post receives ahead.

From the rank schedules every rank derives, for each link (kind, source rank,
destination rank), the ordered list of messages it carries; a message is the
activation (``F``) or the gradient (``B``) entering a virtual stage for a
micro-batch, and who sends it comes from the schedule walker's dependency rule
(``schedules.expected_messages``). The sender numbers messages in its own
action order, the receiver in its own; ``message_plan`` checks that the two
orders agree, so a link never needs reordering (and NCCL's in-order matching is safe).

A receiver thread per incoming link walks its list: post the header receive,
then the data receives as soon as the header says what to allocate, and put the
value in the step's mailbox (``mailbox.Mailbox``). Receives therefore run ahead
of the compute, while the rank works on earlier actions.

On a GPU each link receives on a CUDA stream of its own, made once and reused
by every step (``LinkStreams``): the caching allocator caches blocks per
stream, so a fresh stream per step would never reuse a receive buffer, and
streams taken from the pool NCCL also draws from could alias one of its own (these
come from the other, high-priority, pool).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from gpipe_lab.pipeline.distributed.wire import Values, recv_values
from gpipe_lab.pipeline.schedules import MessageKey, Schedule, expected_messages, outgoing, placement_of
from gpipe_lab.pipeline.step.mailbox import Mailbox

LinkKey = tuple[str, int, int]     # ("act" | "grad", source rank, destination rank)


def message_plan(ranks: Schedule, pp_ranks: list[int], num_virtual: int) -> dict[LinkKey, list[MessageKey]]:
    """The ordered messages of every link of one pipeline (global ranks).

    Raises:
        ValueError: a link whose sender produces messages in another order than
            its receiver consumes them.
    """
    S = num_virtual
    rank_of = placement_of(ranks, S)  # the schedule's placement: the rank whose list holds each stage
    sent: dict[LinkKey, list[MessageKey]] = {}
    received: dict[LinkKey, list[MessageKey]] = {}
    for k, actions in enumerate(ranks):
        for a in actions:
            out = outgoing(a, S)
            if out is not None and rank_of[out[1]] != k:
                link = ("act" if out[0] == "F" else "grad", pp_ranks[k], pp_ranks[rank_of[out[1]]])
                sent.setdefault(link, []).append(out)
        for key, src in expected_messages(actions, rank_of, S).items():
            if src != k:
                link = ("act" if key[0] == "F" else "grad", pp_ranks[src], pp_ranks[k])
                received.setdefault(link, []).append(key)
    for link in sorted(set(sent) | set(received)):
        if sent.get(link) != received.get(link):
            raise ValueError(f"link {link}: sent in order {sent.get(link)} but consumed in order "
                             f"{received.get(link)}; the schedule must keep each link in order")
    return sent


def accept(values: Values, ready: torch.cuda.Event | None, device: torch.device) -> Values:
    """Order the calling thread's stream after a received value's ``ready`` event.

    ``record_stream`` keeps the side stream's buffers from being reused while
    this stream still reads them.
    """
    if ready is None:
        return values
    stream = torch.cuda.current_stream(device)
    stream.wait_event(ready)
    for v in values:
        if v is not None:
            v.record_stream(stream)
    return values


def _receive_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream from the high-priority pool: NCCL draws its own streams from the other one
    (unless told to use high priority), so a receive stream never aliases one of NCCL's."""
    return torch.cuda.Stream(device, priority=-1)


class LinkStreams:
    """One receive stream per incoming link, made on first use and kept for every later step.

    ``factory(device)`` makes a stream (a high-priority CUDA stream on a GPU; off a GPU
    none is made unless a test installs a factory). ``made`` counts the calls.
    """

    def __init__(self, device: torch.device,
                 factory: Callable[[torch.device], torch.cuda.Stream] | None = None) -> None:
        self.device = device
        self.factory = factory if factory is not None else (_receive_stream if device.type == "cuda" else None)
        self.made = 0
        self._streams: dict[LinkKey, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, link: LinkKey) -> torch.cuda.Stream | None:
        """The link's stream (``None`` without a factory)."""
        if self.factory is None:
            return None
        with self._lock:
            if link not in self._streams:
                self._streams[link] = self.factory(self.device)
                self.made += 1
            return self._streams[link]

    def enter(self, stream: torch.cuda.Stream | None) -> AbstractContextManager[Any]:
        """Make ``stream`` current for the receives (on a GPU only)."""
        if stream is None or self.device.type != "cuda":
            return nullcontext()
        return torch.cuda.stream(stream)


def start_receivers(plan: dict[LinkKey, list[MessageKey]], rank: int, links: dict[LinkKey, dist.ProcessGroup],
                    mailbox: Mailbox, device: torch.device, header_device: torch.device,
                    on_thread_start: Callable[[], None] | None = None,
                    header_links: dict[LinkKey, dist.ProcessGroup] | None = None,
                    streams: LinkStreams | None = None) -> list[threading.Thread]:
    """One daemon thread per incoming link, receiving its messages in order.

    Each mailbox item is ``(values, was_tensor, ready)``. On a GPU a thread receives
    on its link's stream (``streams``, one per link for the channel's lifetime) and
    ``ready`` is a CUDA event recorded there once the data is in; the consumer makes
    its stream wait for it (``accept``). Elsewhere ``ready`` is ``None``.
    """
    streams = streams if streams is not None else LinkStreams(device)
    threads = []
    for link, messages in plan.items():
        _, src, dst = link
        if dst != rank:
            continue

        def run(link: LinkKey = link, messages: list[MessageKey] = messages, src: int = src) -> None:
            if on_thread_start is not None:
                on_thread_start()
            side = streams.get(link)
            on_device = side is not None and device.type == "cuda"
            headers = None if header_links is None else header_links.get(link)
            try:
                for seq, key in enumerate(messages):
                    with streams.enter(side):
                        values, was_tensor = recv_values(
                            src, links[link], seq, device, header_device,
                            lambda work, _what: work.wait(), headers)
                    ready: torch.cuda.Event | None = None
                    if on_device:
                        ready = torch.cuda.Event()
                        ready.record(side)
                    mailbox.put(key, (values, was_tensor, ready))
            except BaseException as exc:  # noqa: BLE001 - surfaces in the rank's wait (Undelivered)
                mailbox.break_link(src, exc)

        thread = threading.Thread(target=run, name=f"gpipe-recv-{link[0]}-{src}", daemon=True)
        thread.start()
        threads.append(thread)
    return threads

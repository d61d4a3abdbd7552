"""Who sends what to whom, and the receiver threads that post receives ahead.

From the rank schedules every rank derives, for each link (kind, source rank,
destination rank), the ordered list of messages it carries; a message is the
activation (``F``) or the gradient (``B``) entering a virtual stage for a
micro-batch. The sender numbers messages in its own action order, the receiver
in its own; ``message_plan`` checks that the two orders agree, so a link never
needs reordering (and NCCL's in-order matching is safe).

A receiver thread per incoming link walks its list: post the header receive,
then the data receives as soon as the header says what to allocate, and drop
the value in the ``Inbox``. Receives therefore run ahead of the compute, while
the rank works on earlier actions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from gpipe_lab.pipeline.channel import MessageKey, incoming, outgoing
from gpipe_lab.pipeline.distributed.failure import (
    POLL_SECONDS,
    AbortChannel,
    PeerFailedError,
    PeerTimeoutError,
)
from gpipe_lab.pipeline.distributed.wire import recv_values
from gpipe_lab.pipeline.errors import describe
from gpipe_lab.pipeline.schedules import Action, Schedule

LinkKey = tuple[str, int, int]     # ("act" | "grad", source rank, destination rank)


def message_plan(ranks: Schedule, pp_ranks: list[int], num_virtual: int) -> dict[LinkKey, list[MessageKey]]:
    """The ordered messages of every link of one pipeline (global ranks).

    Raises:
        ValueError: a link whose sender produces messages in another order than
            its receiver consumes them.
    """
    K, S = len(ranks), num_virtual
    sent: dict[LinkKey, list[MessageKey]] = {}
    received: dict[LinkKey, list[MessageKey]] = {}
    for k, actions in enumerate(ranks):
        for a in actions:
            out = outgoing(a, S)
            if out is not None and out[1] % K != k:
                link = ("act" if out[0] == "F" else "grad", pp_ranks[k], pp_ranks[out[1] % K])
                sent.setdefault(link, []).append(out)
            inc = incoming(a, S)
            src = None if inc is None else (a.stage - 1 if inc[0] == "F" else a.stage + 1) % K
            if inc is not None and src != k:
                link = ("act" if inc[0] == "F" else "grad", pp_ranks[src], pp_ranks[k])
                received.setdefault(link, []).append(inc)
    for link in sorted(set(sent) | set(received)):
        if sent.get(link) != received.get(link):
            raise ValueError(f"link {link}: sent in order {sent.get(link)} but consumed in order "
                             f"{received.get(link)}; the schedule must keep each link in order")
    return sent


class Inbox:
    """Values received (or handed over locally) for this rank, keyed by message."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[MessageKey, tuple] = {}
        self._error: tuple[BaseException, int] | None = None

    def put(self, key: MessageKey, value: tuple) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def fail(self, exc: BaseException, peer: int) -> None:
        with self._cond:
            if self._error is None:
                self._error = (exc, peer)
            self._cond.notify_all()

    def get(self, key: MessageKey, peer: int, timeout: float, abort: AbortChannel) -> tuple:
        """Block until ``key`` arrives, polling the abort channel and the deadline.

        A dead peer closes the link, which fails the receive: what it sent before is
        still delivered, so the error names the first message that never came.

        Raises:
            PeerFailedError: the receive from ``peer`` failed, ``peer`` went away, or a rank aborted;
                the message ends with ``[in stage s, forward|backward of micro-batch i]``.
            PeerTimeoutError: nothing arrived within ``timeout`` seconds.
        """
        what = "activation" if key[0] == "F" else "gradient"
        where = describe(key[1], Action(key[1], key[0], key[2]))  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                error: PeerFailedError | None = None
                self._cond.release()
                try:
                    if self._error is not None:
                        exc, src = self._error
                        error = abort.explain(f"receiving the {what} of micro-batch {key[2]} from rank {src}",
                                              [src], exc, where)
                    else:
                        abort.check()
                except PeerFailedError as exc:
                    error = abort.explain_error(exc, where)
                finally:
                    self._cond.acquire()
                if error is not None:
                    raise error
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(
                        f"rank {abort.rank} waited more than {timeout:g} s for the {what} of "
                        f"micro-batch {key[2]} from rank {peer}; is rank {peer} alive? [in {where}]", peer, timeout)
                self._cond.wait(POLL_SECONDS)
            return self._items.pop(key)


def start_receivers(plan: dict[LinkKey, list[MessageKey]], rank: int, links: dict[LinkKey, object],
                    inbox: Inbox, device: torch.device, header_device: torch.device,
                    on_thread_start: Callable[[], None] | None = None) -> list[threading.Thread]:
    """One daemon thread per incoming link, receiving its messages in order."""
    threads = []
    for link, messages in plan.items():
        _, src, dst = link
        if dst != rank:
            continue

        def run(link: LinkKey = link, messages: list[MessageKey] = messages, src: int = src) -> None:
            if on_thread_start is not None:
                on_thread_start()
            try:
                for seq, key in enumerate(messages):
                    value = recv_values(src, links[link], seq, device, header_device,
                                        lambda work, _what: work.wait())  # type: ignore[attr-defined]
                    inbox.put(key, value)
            except BaseException as exc:  # noqa: BLE001 - surfaces in Inbox.get
                inbox.fail(exc, src)

        thread = threading.Thread(target=run, name=f"gpipe-recv-{link[0]}-{src}", daemon=True)
        thread.start()
        threads.append(thread)
    return threads

"""Sends released on completion and receive streams made once per link, without processes."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from gpipe_lab.pipeline.distributed.failure import AbortChannel, PeerFailedError
from gpipe_lab.pipeline.distributed.links import LinkStreams
from gpipe_lab.pipeline.distributed.sends import InFlightSends


class HeldWork:
    """A send that completes when ``done`` is set (or fails with ``error``)."""

    def __init__(self, peer: int = 1, error: BaseException | None = None) -> None:
        self.done, self.peer, self.error = threading.Event(), peer, error

    def wait(self) -> bool:
        if not self.done.wait(30.0):
            raise TimeoutError("the test never completed this send")
        if self.error is not None:
            raise self.error
        return True


def test_a_sent_tensor_is_dropped_as_soon_as_its_send_completes() -> None:
    sends = InFlightSends()
    first, second = HeldWork(), HeldWork()
    a, b = torch.ones(1000), torch.ones(1000)
    ref_a, ref_b = weakref.ref(a), weakref.ref(b)
    sends.add([(first, a), (second, b)])
    del a, b
    assert not sends.idle(0.05) and ref_a() is not None
    first.done.set()
    second.done.set()
    assert sends.idle(30.0)
    gc.collect()
    assert ref_a() is None and ref_b() is None and sends.released == 2
    sends.close(30.0, AbortChannel(None, 0))


def test_a_failed_send_surfaces_in_close_naming_its_peer() -> None:
    sends = InFlightSends()
    work = HeldWork(peer=3, error=RuntimeError("Connection closed by peer"))
    sends.add([(work, torch.ones(1))])
    work.done.set()
    with pytest.raises(PeerFailedError, match="rank 3"):
        sends.close(30.0, AbortChannel(None, 0))


def test_receive_streams_are_made_once_per_link() -> None:
    made: list[torch.device] = []
    streams = LinkStreams(torch.device("cpu"), factory=lambda d: made.append(d) or object())
    links = [("act", 0, 1), ("grad", 2, 1)]
    got = [[streams.get(link) for link in links] for _ in range(3)]  # three steps
    assert streams.made == len(made) == 2 and got[0] == got[1] == got[2] and got[0][0] is not got[0][1]
    assert LinkStreams(torch.device("cpu")).get(links[0]) is None  # no stream off a GPU


class DeviceSend(HeldWork):
    """Like an NCCL send: ``wait()`` before completion would order a stream; completion is polled."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_before_done = False

    def wait(self) -> bool:
        self.waited_before_done |= not self.done.is_set()
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class CudaLike:
    """A stand-in for a CUDA tensor (only ``is_cuda`` is read)."""

    is_cuda = True


def test_a_device_send_is_polled_and_never_waited_before_it_completes() -> None:
    sends = InFlightSends()
    work = DeviceSend()
    sends.add([(work, CudaLike())])
    assert not sends.idle(0.05)
    work.done.set()
    assert sends.idle(30.0) and not work.waited_before_done
    sends.close(30.0, AbortChannel(None, 0))

"""NCCL-shaped plumbing tested on CPU: a Work whose wait() returns before the device finished."""

from __future__ import annotations

import os

import pytest
import torch

from gpipe_lab.pipeline.distributed.failure import AbortChannel, PeerTimeoutError, wait_works
from gpipe_lab.pipeline.distributed.links import accept
from gpipe_lab.pipeline.distributed.resolve import nccl_failure_settings


class DeviceWork:
    """Like an NCCL Work: ``wait()`` returns at once; done only after ``polls`` completion checks."""

    def __init__(self, polls: int | None, peer: int = 1) -> None:
        self.polls, self.peer, self.checks = polls, peer, 0

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        self.checks += 1
        return self.polls is not None and self.checks >= self.polls


def test_a_stuck_device_work_meets_the_deadline_with_a_named_error() -> None:
    abort = AbortChannel(None, 0)
    with pytest.raises(PeerTimeoutError, match="rank 0 waited more than 0.3 s for rank 1"):
        wait_works([DeviceWork(None)], "sending activations/gradients", None, 0.3, abort)


def test_a_device_work_is_waited_until_it_completes() -> None:
    work = DeviceWork(polls=50)
    wait_works([work], "sharing the loss", 1, 30.0, AbortChannel(None, 0))
    assert work.checks >= 50


def test_accept_without_an_event_hands_values_over_unchanged() -> None:
    values = (torch.ones(2), None)
    assert accept(values, None, torch.device("cpu")) is values


def test_nccl_failure_settings_turn_on_async_error_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert nccl_failure_settings(42.0).total_seconds() == 42.0
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # a user's choice is kept
    nccl_failure_settings()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"

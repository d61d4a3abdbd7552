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


def test_every_communicator_is_made_before_step_one_on_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for NCCL: collectives are recorded, CUDA tensors are fake (no GPU here). The
    pipeline and data-parallel groups each run one collective on this rank's GPU at set-up (NCCL
    makes a communicator at its first collective; the data-parallel one used to be made inside
    step 1's backward), and the barrier names the GPU."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gpipe_lab.pipeline.distributed.topology import Topology, barrier, connect_groups

    calls: list[tuple[str, object, object]] = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(("all_reduce", group, t.device)))
    monkeypatch.setattr(dist, "barrier", lambda group=None, device_ids=None: calls.append(("barrier", group,
                                                                                           device_ids)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", None, device)))
    topo = Topology(world_size=4, rank=3, num_stages=2, pp_group="pp", dp_group="dp")
    gpu = torch.device("cuda", 3)
    with FakeTensorMode():
        connect_groups(topo, gpu)
    barrier(topo.pp_group, gpu)
    assert calls == [("all_reduce", "pp", gpu), ("all_reduce", "dp", gpu), ("synchronize", None, gpu),
                     ("barrier", "pp", [3])]
    calls.clear()
    barrier("pp", torch.device("cpu"))  # a CPU rank: no device to name
    assert calls == [("barrier", "pp", None)]


def test_the_process_group_is_bound_to_the_local_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_lab.pipeline.distributed.resolve import process_group_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert process_group_device("nccl") == {"device_id": torch.device("cuda", 2)}
    assert process_group_device("gloo") == {}
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match="LOCAL_RANK=4 but this process sees 4 CUDA device"):
        process_group_device("nccl")

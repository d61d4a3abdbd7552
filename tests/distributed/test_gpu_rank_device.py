"""DistributedGPipe's device: the main thread is bound to it, and outputs are broadcast as CPU tensors."""

from __future__ import annotations

import pickle

import pytest
import torch

from gpipe_lab.pipeline.distributed.resolve import bind_device, resolve_device, to_cpu


def test_bind_device_sets_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    bind_device(torch.device("cuda", 3))
    bind_device(torch.device("cpu"))
    assert calls == [torch.device("cuda", 3)]


def test_explicit_cuda_device_gets_an_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)


def test_broadcast_payload_holds_no_device_tensor() -> None:
    out = (torch.ones(2, device="meta"), {"a": [torch.zeros(1, device="meta")]}, 3)
    # a meta tensor cannot be copied to the CPU: the walk must reach every tensor
    with pytest.raises(NotImplementedError):
        to_cpu(out)
    real = (torch.ones(2, requires_grad=True) * 2, {"a": [torch.zeros(1)]}, 3)
    moved = to_cpu(real)
    assert moved[0].device.type == "cpu" and not moved[0].requires_grad
    assert pickle.loads(pickle.dumps(moved))[1]["a"][0].shape == (1,)


def test_two_ranks_on_one_gpu_are_refused_by_name() -> None:
    from gpipe_lab.pipeline.distributed.resolve import local_rank_device

    assert local_rank_device("1", 2) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but this process sees 2 CUDA device\(s\).*"
                                         r"--nproc-per-node=2.*device='cuda'"):
        local_rank_device("2", 2)
    with pytest.raises(ValueError, match=r"LOCAL_RANK='x' is not an integer"):
        local_rank_device("x", 2)


def test_the_nccl_default_device_follows_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device(None) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # used to wrap around onto cuda:0, shared with rank 0
    with pytest.raises(ValueError, match="LOCAL_RANK=1 but this process sees 1 CUDA device"):
        resolve_device(None)

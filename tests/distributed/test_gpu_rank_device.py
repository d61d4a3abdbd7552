"""DistributedGPipe's device: the main thread is bound to it, and outputs are broadcast as CPU tensors."""

from __future__ import annotations

import pickle

import pytest
import torch

from gpipe_lab.pipeline.distributed.resolve import bind_device, local_rank_device, resolve_device, to_cpu


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


def _placement(devices: list[str] | None, K: int, D: int, per_node: int) -> dict[int, str | None]:
    """Each global rank's ``stage_device`` for a D × K world of ``per_node`` processes per node."""
    from gpipe_lab.pipeline.distributed.resolve import stage_device
    from gpipe_lab.pipeline.distributed.topology import Topology

    return {r: stage_device(devices, Topology(D * K, r, K), r % per_node, per_node) for r in range(D * K)}


@pytest.mark.parametrize(("K", "D", "per_node"), [(2, 2, 4), (2, 3, 6), (2, 4, 4), (4, 2, 2), (3, 2, 6)])
def test_replicas_of_a_stage_get_their_own_gpu(K: int, D: int, per_node: int) -> None:
    """D × K on one node and on several: one GPU per rank of a node, each rank on its stage's
    device of its node (the old rule, ``devices[stage]``, put every replica of a stage on one GPU)."""
    per_stage = [f"cuda:{k % per_node}" for k in range(K)]  # one replica's GPUs, as a node numbers them
    placed = _placement(per_stage, K, D, per_node)
    for node in range(D * K // per_node):
        ranks = range(node * per_node, (node + 1) * per_node)
        assert sorted(placed[r] for r in ranks) == sorted(f"cuda:{i}" for i in range(per_node)), node
    # with devices = cuda:0..K-1 the layout is torchrun's default, cuda:<LOCAL_RANK>
    if per_node >= K:
        assert placed == {r: f"cuda:{r % per_node}" for r in range(D * K)}
        assert _placement(None, K, D, per_node) == dict.fromkeys(range(D * K))  # resolve_device's default
        assert all(local_rank_device(str(r % per_node), per_node) == torch.device(placed[r])
                   for r in range(D * K))
    # CPU stages share the host; one device per local rank is taken as given
    assert set(_placement(["cpu"] * K, K, D, per_node).values()) == {"cpu"}
    own = [f"cuda:{per_node - 1 - i}" for i in range(per_node)]
    if per_node != K:
        assert _placement(own, K, D, per_node) == {r: own[r % per_node] for r in range(D * K)}


def test_a_device_list_that_would_share_a_gpu_is_refused() -> None:
    from gpipe_lab.pipeline.options import OptionError

    with pytest.raises(OptionError, match=r"puts local ranks 0 and 1 both on cuda:0"):
        _placement(["cuda:0", "cuda:0"], 2, 1, 2)
    with pytest.raises(OptionError, match=r"has 3 entries for 2 pipeline stages.*one per stage \(2\).*\(4\)"):
        _placement(["cuda:0", "cuda:1", "cuda:2"], 2, 2, 4)
    with pytest.raises(OptionError, match=r"puts local ranks 1 and 2 both on cuda:1"):
        _placement(["cuda:0", "cuda:1", "cuda:1", "cuda:3"], 2, 2, 4)

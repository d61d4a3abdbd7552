"""Device resolution and placement: "cuda" gets an index, the default is the CPU, targets follow the last stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.devices.assignment import move_target, normalize_device, resolve_devices

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with 4 visible GPUs whose current device is 2 (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)


def test_cuda_without_index_is_the_current_device(fake_cuda: None) -> None:
    assert normalize_device("cuda") == torch.device("cuda", 2)
    assert resolve_devices(["cuda"] * 3, 3) == [torch.device("cuda", 2)] * 3
    assert normalize_device("cuda:1") == torch.device("cuda", 1)


def test_cuda_index_beyond_the_machine_is_named(fake_cuda: None) -> None:
    with pytest.raises(ValueError, match=r"'cuda:7'.*4 visible CUDA device"):
        normalize_device("cuda:7")


def test_default_placement_is_cpu_even_with_gpus(fake_cuda: None) -> None:
    assert resolve_devices(None, 2) == [torch.device("cpu")] * 2
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), partitions=2, chunks=2)
    assert pipe.devices == [torch.device("cpu")] * 2
    assert all(p.device.type == "cpu" for p in pipe.parameters())


def test_bad_device_names_the_value() -> None:
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        normalize_device("gpu0")
    with pytest.raises(ValueError, match="2 partitions need 2 devices"):
        resolve_devices(["cpu"], 2)


def test_cuda_refused_clearly_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        normalize_device("cuda")


def test_targets_move_to_the_last_stage_device() -> None:
    t = torch.ones(3)
    moved = move_target((t, [t], {"y": t}, 5), torch.device("meta"))
    assert moved[0].device.type == "meta" and moved[1][0].device.type == "meta"
    assert moved[2]["y"].device.type == "meta" and moved[3] == 5
    assert move_target(t, torch.device("cpu")) is t  # already there: no copy


@needs_cuda
def test_cuda_string_runs_and_targets_follow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = GPipe(model, partitions=2, chunks=2, devices=["cuda", "cuda"])
    assert all(d.index is not None for d in pipe.devices)
    seen = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(y.device)
        return nn.functional.mse_loss(out, y)

    pipe.train_step(torch.randn(4, 8), torch.randn(4, 2), loss_fn)  # targets given on the CPU
    assert seen and all(d == pipe.devices[-1] for d in seen)

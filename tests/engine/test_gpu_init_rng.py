"""Meta-device initialization seeds only its own device's generator and restores every generator after."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline.partitioning.materialize import init_layer, place_layers, seeded_init


def test_cpu_initialization_leaves_cuda_generators_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    touched: list[str] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: touched.append("manual_seed_all"))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: touched.append("manual_seed"))
    before = torch.random.get_rng_state()
    with torch.device("meta"):
        part = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    place_layers(part, 0, torch.device("cpu"), seed=5)
    assert touched == []  # torch.manual_seed would have reseeded (or queued reseeding) every GPU
    assert torch.equal(torch.random.get_rng_state(), before)
    reference = seeded_init(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(part.parameters(), reference.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_initialization_restores_the_device_generator() -> None:
    before = torch.cuda.get_rng_state(0)
    layer = nn.Linear(4, 4, device="cuda:0")
    init_layer(0, layer, seed=5, init_fn=None)
    first = layer.weight.clone()
    init_layer(0, layer, seed=5, init_fn=None)
    assert torch.equal(layer.weight, first) and torch.equal(torch.cuda.get_rng_state(0), before)

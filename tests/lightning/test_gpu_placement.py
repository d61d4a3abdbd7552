"""Lightning placement: stages stay on their own devices, only the rest of the module goes to the root device."""

from __future__ import annotations

import torch
from torch import nn

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.lightning.placement import place_outside
from helpers.strategy import TinyData, TinyRegressor, trainer


class WithHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("steps", torch.zeros(()))


def test_only_tensors_outside_the_layers_move() -> None:
    m = WithHead()
    scale = m.scale
    place_outside(m, m.layers, torch.device("meta"))
    assert m.scale is scale and m.scale.device.type == "meta" and m.steps.device.type == "meta"
    assert all(t.device.type == "cpu" for t in (*m.layers.parameters(), *m.layers.buffers()))


def test_a_cpu_trainer_keeps_every_stage_on_the_cpu() -> None:
    strategy = GPipeStrategy(partitions=2, chunks=2)
    module = TinyRegressor()
    trainer(strategy, max_steps=2).fit(module, TinyData())
    assert strategy.pipe.devices == [torch.device("cpu")] * 2
    assert all(p.device.type == "cpu" for p in module.parameters())

"""module_walk.walk: the same modules, parameters and buffers, in the same order, as torch's traversals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from gpipe_lab.models.preset_registry import build
from gpipe_lab.pipeline.stage.module_walk import walk


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.block = nn.Sequential(nn.Linear(6, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU())
        self.again = self.block[0]  # a shared module, seen twice in the tree
        self.head = nn.Linear(6, 10)
        self.head.weight = self.embed.weight  # a shared parameter
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.register_buffer("absent", None)
        self.heads = nn.ModuleDict({"a": nn.Linear(6, 2), "b": nn.LazyLinear(3)})


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def parametrized() -> nn.Module:
    layer = nn.Linear(4, 4)
    parametrize.register_parametrization(layer, "weight", Symmetric())
    return nn.Sequential(layer, nn.Linear(4, 4))


@pytest.mark.parametrize("make", [Tied, parametrized, lambda: build("amoebanet_d_tiny", "cpu"),
                                  lambda: build("transformer_tiny", "cpu")],
                         ids=["tied-lazy-buffers", "parametrized", "amoebanet_d_tiny", "transformer_tiny"])
def test_walk_lists_what_torch_lists(make) -> None:  # noqa: ANN001
    module = make()
    module = getattr(module, "sequential", module)
    found = walk(module)
    assert [id(m) for m in found.modules] == [id(m) for m in module.modules()]
    assert [id(p) for p in found.parameters] == [id(p) for p in module.parameters()]
    assert [id(b) for b in found.buffers] == [id(b) for b in module.buffers()]


def test_shared_members_count_once_and_none_entries_are_skipped() -> None:
    module = Tied()
    found = walk(module)
    assert sum(p is module.embed.weight for p in found.parameters) == 1
    assert sum(m is module.block[0] for m in found.modules) == 1
    assert all(t is not None for t in (*found.parameters, *found.buffers))
    assert any(b is module.scratch for b in found.buffers)  # non-persistent buffers too


@pytest.mark.parametrize(("schedule", "checkpoint"), [("gpipe", "except_last"), ("zb-h1", "never")])
def test_a_step_walks_each_stage_once_not_through_torchs_traversals(schedule, checkpoint, monkeypatch) -> None:  # noqa: ANN001
    """The verdict, the memory count, the replay's BatchNorm guard and the split backward share
    the step's one walk: no ``named_modules`` traversal (1.4 ms each on the AmoebaNet analogue)."""
    from torch.nn import functional as F

    from gpipe_lab import GPipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.Dropout(0.1),
                          nn.Linear(8, 4))
    pipe = GPipe(model, balance=[3, 3], chunks=4, checkpoint=checkpoint, schedule=schedule)
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    pipe.train_step(x, y, F.mse_loss)  # the first step probes random draws
    traversals = []
    original = nn.Module.named_modules

    def counting(self, memo=None, prefix="", remove_duplicate=True):  # noqa: ANN001, ANN202
        if memo is None:
            traversals.append(type(self).__name__)
        return original(self, memo, prefix, remove_duplicate)

    monkeypatch.setattr(nn.Module, "named_modules", counting)
    pipe.train_step(x, y, F.mse_loss)
    assert traversals == []

"""Layers built in ``configure_model`` under ``GPipeStrategy`` are created on ``meta`` and
allocated stage by stage on each stage's device; training then equals the unpipelined model
started from ``seeded_init`` (the same per-layer seeded init), and a module built on meta
that the strategy cannot initialize is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.pipeline import GPipe, seeded_init
from helpers.strategy import MetaRegressor, TinyData, tiny_layers, trainer


class BiasByIndex(MetaRegressor):
    """A custom ``init_layer``: the engine must call it with each layer's global index."""

    def init_layer(self, index: int, layer: nn.Module) -> None:
        super().init_layer(index, layer)
        if isinstance(layer, nn.Linear):
            layer.bias.fill_(index / 10)


def unpipelined_losses(module: MetaRegressor, seed: int, steps: int) -> tuple[list[float], nn.Sequential]:
    """Adam on the host-built layers, initialized as the pipeline initializes them."""
    layers = seeded_init(tiny_layers(module.width), seed, module.init_layer)
    opt = torch.optim.Adam(layers.parameters(), lr=module.lr)
    losses = []
    for x, y in list(TinyData().train_dataloader())[:steps]:
        opt.zero_grad()
        loss = nn.functional.mse_loss(layers(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, layers


def test_configure_model_builds_on_meta_and_trains_like_the_unpipelined_model() -> None:
    module = BiasByIndex()
    strategy = GPipeStrategy(partitions=2, chunks=2, seed=5)
    trainer(strategy, max_epochs=1).fit(module, TinyData())
    assert module.built_on == torch.device("meta")
    assert not any(p.is_meta for p in module.parameters())
    for part, device in zip(strategy.pipe.partitions, strategy.pipe.devices):  # type: ignore[union-attr]
        assert {p.device for p in part.parameters()} == {device}
    expected, layers = unpipelined_losses(module, 5, len(module.losses))
    assert len(module.losses) == 4
    assert module.losses == pytest.approx(expected, abs=1e-5)
    for got, want in zip(module.layers.parameters(), layers.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_init_module_empty_init_false_builds_on_the_host() -> None:
    strategy = GPipeStrategy(partitions=2, chunks=2)
    t = trainer(strategy)
    with t.init_module(empty_init=False):
        host = nn.Linear(2, 2)
    with t.init_module():
        meta = nn.Linear(2, 2)
    assert not host.weight.is_meta and meta.weight.is_meta


class Scale(nn.Module):
    """A module with a buffer and no reset: built on meta it cannot be initialized."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class MetaOutsideLayers(MetaRegressor):
    def configure_model(self) -> None:
        super().configure_model()
        if getattr(self, "scale", None) is None:
            self.scale = Scale()


def test_meta_module_outside_the_layers_without_reset_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'scale' \(Scale\).*meta device.*reset_parameters"):
        trainer(GPipeStrategy(partitions=2, chunks=2), max_steps=1).fit(MetaOutsideLayers(), TinyData())


def test_engine_materializes_meta_layers_on_each_stage_and_refuses_half_meta() -> None:
    with torch.device("meta"):
        meta = tiny_layers()
    pipe = GPipe(meta, partitions=3, chunks=2, seed=7)
    reference = seeded_init(tiny_layers(), 7)
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(reference(x), y)
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    for got, want in zip(meta.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=0)
    factory_pipe = GPipe(tiny_layers, partitions=2, chunks=2, seed=7)  # a factory: called on meta
    torch.testing.assert_close(factory_pipe[0].weight, reference[0].weight)

    half = tiny_layers()
    half[2].bias = nn.Parameter(torch.empty(16, device="meta"))
    with pytest.raises(ValueError, match="layer 2 is partly on the meta device"):
        GPipe(half, partitions=2)

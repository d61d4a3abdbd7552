"""16-mixed under the pipeline: the GradScaler unscales, skips an overflowing step and updates every step."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.lightning.scaling import agree_on_overflow, unscale_loss
from helpers.faults import BAD_STEP, Faulty
from helpers.strategy import TinyData, trainer


class CountingScaler(torch.amp.GradScaler):
    """A CPU GradScaler that records its scale at every ``update``."""

    def __init__(self) -> None:
        super().__init__("cpu", init_scale=2.0 ** 8, growth_interval=1000)
        self.scales: list[float] = []

    def update(self, new_scale: object = None) -> None:
        super().update(new_scale)
        self.scales.append(self.get_scale())


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_an_overflow_is_the_scaler_s_to_skip(policy: str) -> None:
    scaler = CountingScaler()
    module = Faulty(where="backward")  # stage 0's gradients are inf on step BAD_STEP
    strategy = GPipeStrategy(partitions=2, chunks=2, nonfinite=policy)
    trainer(strategy, max_steps=5, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(
        module, TinyData())
    assert scaler.scales == [256.0] * BAD_STEP + [128.0] * (5 - BAD_STEP)  # updated every step, backed off once
    assert module.optimizer_steps == 4  # only the overflowing step skipped
    assert all(torch.isfinite(torch.tensor(loss)) for loss in module.losses)


def test_logged_loss_is_unscaled_without_reading_the_scale() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    loss = torch.tensor(6.4)
    torch.testing.assert_close(unscale_loss(loss, scaler), torch.tensor(0.1))


def test_the_inf_verdict_is_shared_by_every_device_entry() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    agree_on_overflow(scaler)  # no process group: the local verdict is the global one
    scaler.scale(torch.ones(()))  # the scale tensor is created lazily
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([float("inf"), 1.0])
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 and torch.equal(p.detach(), torch.ones(2))  # skipped, backed off

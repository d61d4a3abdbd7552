"""The non-finite policy through Lightning: ``GPipeStrategy(nonfinite=...)`` (config key
``pipeline.nonfinite``). ``raise`` stops ``Trainer.fit`` with ``NonFiniteError`` naming the
step; ``skip`` drops that step (parameters untouched) and training goes on."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.pipeline import NonFiniteError
from helpers.strategy import TinyData, TinyRegressor, trainer

BAD_STEP = 2


class PoisonedRegressor(TinyRegressor):
    """The loss of step ``BAD_STEP`` is NaN; records the parameters before every step."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots: list[list[torch.Tensor]] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.snapshots.append([p.detach().clone() for p in self.parameters()])

    def loss_fn(self, outputs, targets):
        loss = super().loss_fn(outputs, targets)
        return loss * math.nan if self.trainer.global_step == BAD_STEP else loss


def _strategy(policy: str) -> GPipeStrategy:
    if "nonfinite" not in inspect.signature(GPipeStrategy).parameters:
        pytest.xfail("GPipeStrategy does not expose the engine's nonfinite policy")
    return GPipeStrategy(partitions=2, chunks=4, nonfinite=policy)


@pytest.mark.timeout(120)
def test_raise_stops_fit_naming_the_step():
    with pytest.raises(NonFiniteError, match=f"step {BAD_STEP}: loss is nan"):
        trainer(_strategy("raise"), max_steps=5).fit(PoisonedRegressor(), TinyData())


@pytest.mark.timeout(120)
def test_skip_drops_the_step_and_training_continues():
    module = PoisonedRegressor()
    trainer(_strategy("skip"), max_steps=5).fit(module, TinyData())
    before, after = module.snapshots[BAD_STEP], module.snapshots[BAD_STEP + 1]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the skipped step changed the parameters"
    assert not all(torch.equal(a, b) for a, b in zip(module.snapshots[0], module.snapshots[1]))
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert len(module.snapshots) >= 4

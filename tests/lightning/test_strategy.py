"""GPipeStrategy: equivalence with unpipelined training, the zeroing trap, manual
optimization, accumulation, clipping, bf16, validation through the pipeline, checkpoints."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from gpipe_lab.lightning import GPipeStrategy
from helpers.strategy import TinyData, TinyRegressor, trainer


def fit_losses(strategy: object, manual: bool = False, steps: int = 5, **kwargs: object) -> list[float]:
    module = TinyRegressor(manual=manual)
    trainer(strategy, max_steps=steps, **kwargs).fit(module, TinyData())
    return module.losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return fit_losses("auto")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_losses_equal_unpipelined(reference: list[float], k: int) -> None:
    losses = fit_losses(GPipeStrategy(partitions=k, chunks=4, seed=0))
    assert losses == pytest.approx(reference, abs=1e-5)
    assert len(losses) == 5


def test_schedule_and_checkpoint_modes_equal(reference: list[float]) -> None:
    for schedule, mode in (("1f1b", "always"), ("gpipe", "never")):
        losses = fit_losses(GPipeStrategy(partitions=2, chunks=2, schedule=schedule, checkpoint=mode))
        assert losses == pytest.approx(reference, abs=1e-5), (schedule, mode)


def test_manual_optimization(reference: list[float]) -> None:
    assert fit_losses(GPipeStrategy(partitions=2, chunks=4), manual=True) == pytest.approx(reference, abs=1e-5)


def test_logged_loss_is_the_real_loss() -> None:
    module = TinyRegressor()
    t = trainer(GPipeStrategy(partitions=2, chunks=4), max_steps=3)
    t.fit(module, TinyData())
    assert float(t.callback_metrics["train/loss"]) == pytest.approx(module.losses[-1])
    assert module.losses[-1] > 0  # not the placeholder


def test_accumulation_and_global_norm_clipping() -> None:
    kwargs = dict(steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05)
    plain = fit_losses("auto", **kwargs)
    piped = fit_losses(GPipeStrategy(partitions=4, chunks=2), **kwargs)
    assert len(piped) == 6  # two mini-batches per optimizer step
    assert piped == pytest.approx(plain, abs=1e-5)


def test_bf16_mixed_runs_under_autocast() -> None:
    fp32 = fit_losses(GPipeStrategy(partitions=2, chunks=2), steps=2)
    bf16 = fit_losses(GPipeStrategy(partitions=2, chunks=2), steps=2, precision="bf16-mixed")
    assert bf16[0] == pytest.approx(fp32[0], rel=2e-2)
    assert bf16 != fp32  # autocast reached the stage threads


def test_validation_runs_the_pipeline() -> None:
    module = TinyRegressor()
    strategy = GPipeStrategy(partitions=2, chunks=2)
    t = trainer(strategy, max_steps=4, limit_val_batches=2)  # one epoch: validates
    t.fit(module, TinyData())
    assert "val/loss" in t.callback_metrics
    assert strategy.timeline is not None
    assert {e.kind for e in strategy.timeline.events} >= {"F"}
    assert not {e.kind for e in strategy.timeline.events} & {"B"}  # last call was forward-only
    plain = TinyRegressor()
    plain.load_state_dict(module.state_dict())
    x, y = TinyData().data.tensors
    with torch.no_grad():
        expected = sum(float(torch.nn.functional.mse_loss(plain.layers(x[i:i + 16]), y[i:i + 16]))
                       for i in (0, 16)) / 2
    result = t.validate(module, TinyData(), verbose=False)[0]["val/loss"]
    assert result == pytest.approx(expected, abs=1e-6)


def test_registered_and_bad_arguments() -> None:
    assert "gpipe" in StrategyRegistry
    with pytest.raises(ValueError, match="transport"):
        GPipeStrategy(transport="carrier-pigeon")
    with pytest.raises(ValueError, match="checkpoint"):
        GPipeStrategy(checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks"):
        GPipeStrategy(chunks=0)


def test_checkpoint_resumes_with_another_k(tmp_path) -> None:
    full = TinyRegressor()
    trainer(GPipeStrategy(partitions=2, chunks=4), max_epochs=2).fit(full, TinyData())
    assert len(full.losses) == 8
    first = TinyRegressor()
    t = trainer(GPipeStrategy(partitions=2, chunks=4), max_epochs=1)
    t.fit(first, TinyData())
    path = tmp_path / "k2.ckpt"
    t.save_checkpoint(path)
    keys = set(torch.load(path, weights_only=False)["state_dict"])
    assert keys == set(TinyRegressor().state_dict())  # original layer names
    for k in (1, 4):
        resumed = TinyRegressor()
        resumed.layers[0].weight.data.zero_()  # must come from the checkpoint
        trainer(GPipeStrategy(partitions=k, chunks=4), max_epochs=2).fit(resumed, TinyData(), ckpt_path=path)
        assert resumed.losses == pytest.approx(full.losses[4:], abs=1e-5), k
    plain = TinyRegressor()
    trainer("auto", max_epochs=2).fit(plain, TinyData(), ckpt_path=path)
    assert plain.losses == pytest.approx(full.losses[4:], abs=1e-5)

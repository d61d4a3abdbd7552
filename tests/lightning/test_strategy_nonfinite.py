"""The non-finite policy end to end: ``GPipeStrategy(nonfinite=...)``, the config key
``pipeline.nonfinite`` and ``DistributedGPipe(nonfinite=...)`` (every rank decides alike).

A layer emits inf on a chosen training step: ``"raise"`` stops training with the
engine's ``NonFiniteError`` naming the step (and, for gradients, the stage); ``"skip"``
skips that mini-batch's optimizer step, so the run equals one that never stepped on
that batch, and ``train/skipped_steps`` counts it. (The Lightning distributed transport's
case is in test_strategy_distributed.py, sharing that file's launch.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gpipe_lab.app.config.groups import ConfigError, validate
from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.pipeline import NonFiniteError
from helpers.faults import BAD_STEP, Faulty, InfAtStep, nonfinite_worker
from helpers.strategy import TinyData, trainer


def test_skip_drops_exactly_that_optimizer_step() -> None:
    reference = Faulty(step=-1, skip_batch=BAD_STEP)
    trainer("auto", max_steps=5).fit(reference, TinyData())
    module = Faulty()
    strategy = GPipeStrategy(partitions=2, chunks=4, nonfinite="skip")
    t = trainer(strategy, max_steps=5)
    t.fit(module, TinyData())
    assert strategy.pipe.skipped_steps == 1
    assert module.optimizer_steps == 4  # five mini-batches, one skipped
    assert not torch.isfinite(torch.tensor(module.losses[BAD_STEP]))
    good = [i for i in range(5) if i != BAD_STEP]
    assert [module.losses[i] for i in good] == pytest.approx([reference.losses[i] for i in good], abs=1e-5)
    assert float(t.callback_metrics["train/skipped_steps"]) == 1.0


def test_skip_covers_the_accumulation_window() -> None:
    module = Faulty(step=1)  # the second mini-batch of the window [0, 1]
    t = trainer(GPipeStrategy(partitions=2, chunks=2, nonfinite="skip"), max_steps=2, accumulate_grad_batches=2)
    t.fit(module, TinyData())
    assert module.optimizer_steps == 1  # windows [0, 1] (skipped) and [2, 3]
    assert all(torch.isfinite(torch.tensor(module.losses[i])) for i in (0, 2, 3))


def test_raise_stops_training_naming_the_step_and_the_stage() -> None:
    with pytest.raises(NonFiniteError, match=f"step {BAD_STEP}: loss is (inf|nan)"):
        trainer(GPipeStrategy(partitions=2, chunks=4), max_steps=5).fit(Faulty(), TinyData())
    with pytest.raises(NonFiniteError, match=f"step {BAD_STEP}: gradients of stage 0 are not finite"):
        trainer(GPipeStrategy(partitions=2, chunks=4, nonfinite="raise"), max_steps=5).fit(
            Faulty(where="backward"), TinyData())


def test_ignore_and_bad_policy() -> None:
    module = Faulty()
    trainer(GPipeStrategy(partitions=2, chunks=4, nonfinite="ignore"), max_steps=3).fit(module, TinyData())
    assert len(module.losses) == 3
    with pytest.raises(ValueError, match=r"nonfinite: must be one of \['raise', 'skip', 'ignore'\], got 'maybe'"):
        GPipeStrategy(nonfinite="maybe")


# ----------------------------------------------------------------------------- config
def test_config_key_is_validated_and_reaches_the_strategy(tmp_path: Path, monkeypatch) -> None:
    from helpers.app import make_config

    assert make_config().pipeline.nonfinite == "raise"
    with pytest.raises(ConfigError, match=r"pipeline\.nonfinite: must be one of \['raise', 'skip', 'ignore'\]"):
        validate(make_config("pipeline.nonfinite=maybe"))
    assert validate(make_config("pipeline.nonfinite=skip")).options.nonfinite == "skip"

    import gpipe_lab.app.train as train

    built = train.build_module

    def faulty_module(cfg, datamodule):
        module = built(cfg, datamodule)
        bad = InfAtStep(1).attach(module)
        module.layers[-1].register_forward_hook(lambda m, i, out: bad(out))
        return module

    monkeypatch.setattr(train, "build_module", faulty_module)
    common = ("experiment=transformer_tiny", "trainer=smoke", "trainer.max_steps=3", "trainer.limit_val_batches=0",
              "logger=none")
    summary = train.run(make_config(*common, "pipeline.nonfinite=skip", tmp_path=tmp_path))
    assert summary["steps"] == 3
    with pytest.raises(NonFiniteError, match="step 1: loss is (inf|nan)"):
        train.run(make_config(*common, tmp_path=tmp_path / "raise"))


# ----------------------------------------------------------------------------- distributed engine
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_distributed_ranks_agree_on_raise_and_skip() -> None:
    from gpipe_lab.pipeline.distributed.spawn import run_local

    results = run_local(nonfinite_worker, 2, timeout=100)  # in helpers.faults: the workers skip Lightning
    for r in results:
        assert r.exitcode == 0, r.error
    for r in results:  # both ranks, whichever holds the culprit
        v = r.value
        assert v["loss"][0] == "raised" and v["loss"][1].startswith("step 0: loss is "), v["loss"]
        assert "stage 1" in v["loss"][1], v["loss"]  # where the loss is computed
        assert v["grad"] == ("raised", "step 0: gradients of stage 0 are not finite "
                             "(set nonfinite='skip' to skip such steps)"), v["grad"]
        assert v["skip"] == ("ok", True, 1, True), v["skip"]
        assert v["loss_next"] == (True, False, 1)  # a raised step is not counted (as in GPipe)
        assert v["skip_next"] == (True, False, 2)
    with pytest.raises(ValueError, match="nonfinite: must be one of .*, got 'maybe'"):
        from gpipe_lab.pipeline.distributed import DistributedGPipe

        DistributedGPipe(nn.Sequential(nn.Linear(2, 2)), partitions=1, nonfinite="maybe")

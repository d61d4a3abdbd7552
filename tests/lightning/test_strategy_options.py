"""``GPipeStrategy`` takes ``PipelineOptions`` (keyword aliases on top), builds its engine from
them, and attaches to the module only through public methods (no patching, no private state)."""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from gpipe_lab.lightning import DistributedGPipeStrategy, GPipeStrategy, LocalGPipeStrategy, PipelineModule
from gpipe_lab.lightning.engine import PipelineEngine
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.options import OptionError, PipelineOptions
from helpers.strategy import TinyData, TinyRegressor, trainer

SRC = Path(__file__).resolve().parents[2] / "src"


def test_options_reach_the_engine_and_aliases_override_them() -> None:
    options = PipelineOptions(partitions=3, chunks=2, checkpoint="never", schedule="1f1b")
    strategy = GPipeStrategy(options, chunks=4, stage_devices=["cpu", "cpu", "cpu"])
    module = TinyRegressor()
    trainer(strategy, max_steps=1).fit(module, TinyData())
    engine = strategy.pipe
    assert isinstance(engine, PipelineEngine)
    assert (len(engine.balance), engine.chunks, engine.checkpoint, engine.schedule) == (3, 4, "never", "1f1b")
    assert [str(d) for d in engine.devices] == ["cpu", "cpu", "cpu"]
    assert options.chunks == 2  # the caller's options are not changed


def test_module_is_attached_during_fit_and_plain_afterwards() -> None:
    module = TinyRegressor()
    strategy = GPipeStrategy(partitions=2, chunks=2)
    seen: list[object] = []
    module.on_train_batch_start = lambda batch, idx: seen.append(module.pipeline)  # type: ignore[method-assign]
    trainer(strategy, max_steps=2).fit(module, TinyData())
    assert seen == [strategy, strategy]
    assert module.pipeline is None
    x = torch.randn(3, 8)
    assert torch.equal(module(x), module.layers(x))


def test_bad_options_are_refused_once_naming_the_key() -> None:
    with pytest.raises(OptionError, match=r"^virtual_stages: must be an integer >= 1, got 0"):
        GPipeStrategy(virtual_stages=0)
    with pytest.raises(OptionError, match="^options: must be a PipelineOptions, got dict"):
        GPipeStrategy({"partitions": 2})  # type: ignore[arg-type]


def test_strategy_default_chunks_is_the_options_default() -> None:
    module = TinyRegressor()
    strategy = GPipeStrategy(partitions=2)
    trainer(strategy, max_steps=1).fit(module, TinyData())
    assert strategy.pipe.chunks == PipelineOptions().chunks
    assert {e.microbatch for e in strategy.timeline.events} == set(range(PipelineOptions().chunks))


def test_no_private_lightning_state_or_patching_in_the_package() -> None:
    found = subprocess.run(["grep", "-rn", r"object.__setattr__\|_current_fx_name\|sys.path", str(SRC)],
                           capture_output=True, text=True)
    assert found.stdout == "", found.stdout


def test_import_data_does_not_load_the_engine() -> None:
    code = ("import sys, gpipe_lab.data, gpipe_lab.models; "
            "print(sorted(m for m in sys.modules if m.startswith('gpipe_lab.pipeline')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_interleaved_virtual_stages_train_like_unpipelined() -> None:
    reference = TinyRegressor()
    trainer("auto", max_steps=2).fit(reference, TinyData())
    module = TinyRegressor()
    trainer(GPipeStrategy(partitions=2, virtual_stages=2, chunks=4, schedule="interleaved-1f1b"),
            max_steps=2).fit(module, TinyData())
    assert module.losses == pytest.approx(reference.losses, abs=1e-5)


class LossOnly(TinyRegressor):
    """The base ``log_train`` (the loss only): nothing reads the step's outputs."""

    log_train = PipelineModule.log_train  # type: ignore[assignment]


@pytest.mark.parametrize(("module_type", "gathered"), [(TinyRegressor, True), (LossOnly, False)])
def test_outputs_are_gathered_only_for_a_log_train_that_reads_them(module_type: type, gathered: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    original = GPipe.train_step

    def recording(self: GPipe, *args: object, **kwargs: object) -> object:
        asked.append(bool(kwargs.get("return_outputs")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GPipe, "train_step", recording)
    module = module_type()
    t = trainer(GPipeStrategy(partitions=2, chunks=2), max_steps=2)
    t.fit(module, TinyData())
    assert asked == [gathered, gathered]
    assert "train/loss" in t.callback_metrics  # the real loss is logged either way


def test_the_transport_picks_the_strategy_type() -> None:
    local, distributed = GPipeStrategy(partitions=2), GPipeStrategy(PipelineOptions(transport="distributed"))
    assert type(local) is LocalGPipeStrategy and isinstance(local, GPipeStrategy)
    assert type(distributed) is DistributedGPipeStrategy and isinstance(distributed, DDPStrategy)
    assert type(GPipeStrategy(PipelineOptions(transport="distributed"), transport="local")) is LocalGPipeStrategy
    assert type(StrategyRegistry.get("gpipe")) is LocalGPipeStrategy
    assert type(copy.deepcopy(distributed)) is DistributedGPipeStrategy


def test_every_abstract_method_of_lightning_is_implemented_and_each_transport_has_its_collectives() -> None:
    assert not GPipeStrategy.__abstractmethods__  # GPipeStrategy(...) type-checks as a concrete class
    local, distributed = GPipeStrategy(partitions=2), GPipeStrategy(PipelineOptions(transport="distributed"))
    tensor = torch.ones(2)
    assert local.reduce(tensor) is tensor and local.broadcast("x") == "x"  # one process: the identity
    for name in ("reduce", "barrier", "broadcast"):  # the process group's: DDP's, not the one-process ones
        assert getattr(type(distributed), name) is getattr(DDPStrategy, name), name
    assert type(distributed).root_device is DDPStrategy.root_device


def test_keywords_are_options_and_unknown_ones_are_refused() -> None:
    with pytest.raises(OptionError, match=r"^acelerator: unknown pipeline option; allowed: partitions, "):
        GPipeStrategy(acelerator="cpu")
    with pytest.raises(ValueError, match=r"process_group_backend='gloo': only the distributed transport"):
        GPipeStrategy(process_group_backend="gloo")
    strategy = GPipeStrategy(PipelineOptions(chunks=3), stage_devices=["cpu", "cpu"], balance=(4, 4))
    assert (strategy.options.devices, strategy.options.balance, strategy.chunks) == (["cpu", "cpu"], [4, 4], 3)


#: A value other than the default for every option (``transport``: the other transport's tests).
NON_DEFAULT = dict(partitions=2, balance=[2, 2, 2, 3], chunks=2, checkpoint="never", schedule="interleaved-1f1b",
                   virtual_stages=2, local_stages="auto", deferred_batch_norm=True, cost="flops", seed=11,
                   devices=["cpu", "cpu"], threads_per_stage=1, timeout=77.0, nonfinite="skip", random_replay=False,
                   compile={"backend": "eager"}, track_memory=False, retain_cpu_memory=False)


def test_every_option_given_to_the_strategy_reaches_the_engine() -> None:
    assert set(NON_DEFAULT) | {"transport"} == {f.name for f in fields(PipelineOptions)}, "a new option: add it"
    defaults = PipelineOptions()
    assert all(getattr(defaults, k) != v for k, v in NON_DEFAULT.items())
    strategy = GPipeStrategy(PipelineOptions(**NON_DEFAULT))
    trainer(strategy, max_steps=1).fit(TinyRegressor(), TinyData())
    reached = strategy.pipe.options
    assert replace(reached, devices=[str(d) for d in reached.devices]) == strategy.options

"""Every ``PipelineOptions`` field, set to a value other than its default, reaches the running
engine through each front door: ``GPipe`` (local transport), ``DistributedGPipe`` (gloo
processes), ``GPipeStrategy`` and ``gpipe-train``'s ``run``. A field added to the dataclass
without a value in ``NON_DEFAULT`` fails here first; one that a front door drops fails its test.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.pipeline import DeferredBatchNorm, GPipe, PipelineCore, PipelineOptions, balance_by_cost
from gpipe_lab.pipeline.distributed.spawn import run_local
from helpers.strategy import TinyData, TinyRegressor, trainer

#: one value per field, none of them the default; layouts for an 8-layer model, K=2, v=2
NON_DEFAULT = dict(
    partitions=2, balance=[2, 2, 2, 2], chunks=2, checkpoint="always", schedule="interleaved-1f1b",
    virtual_stages=2, transport="local", local_stages="auto", deferred_batch_norm=True, cost=[1.0] * 8, seed=1234,
    devices=["cpu", "cpu"], threads_per_stage=1, timeout=77.0, nonfinite="skip", random_replay=False,
    compile={"backend": "eager"}, track_memory=False, retain_cpu_memory=False)
#: ``transport`` is the front door's choice: GPipe is local, DistributedGPipe distributed
TRANSPORT_FIELD = "transport"


def options(**changes: object) -> PipelineOptions:
    return PipelineOptions(**{**NON_DEFAULT, **changes})


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def check_engine(pipe: PipelineCore, expected: PipelineOptions, batch_norm: bool = True) -> None:
    """The engine holds ``expected`` and acts on the fields cheap to observe (``batch_norm``:
    the model has BatchNorm layers, which ``deferred_batch_norm`` converts)."""
    assert pipe.options == expected
    for runtime in pipe.runtimes.values():
        assert runtime.track_memory is False and runtime.replay.setting is False
        assert runtime.compiled is not None
    converted = [m for r in pipe.runtimes.values() for m in r.module.modules() if isinstance(m, DeferredBatchNorm)]
    assert bool(converted) == batch_norm


def test_every_field_has_a_non_default_value() -> None:
    default = PipelineOptions()
    names = [f.name for f in fields(PipelineOptions)]
    assert sorted(NON_DEFAULT) == sorted(names), "give each new PipelineOptions field a value here"
    same = [n for n in names if n != TRANSPORT_FIELD and NON_DEFAULT[n] == getattr(default, n)]
    assert not same, same


def test_gpipe_takes_every_option() -> None:
    pipe = GPipe(bn_model(), options=options())
    check_engine(pipe, options())
    assert pipe.threads_per_stage == 1 and [str(d) for d in pipe.devices] == ["cpu", "cpu"]
    assert pipe.seed == 1234
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    pipe.train_step(x * float("nan"), y, F.mse_loss)
    assert pipe.last_step_skipped  # nonfinite="skip"
    # a keyword overrides its field of ``options``
    assert GPipe(bn_model(), options=options(), chunks=4).options.chunks == 4
    with pytest.raises(ValueError, match="transport"):
        GPipe(bn_model(), options=options(transport="distributed"))


def _distributed_worker(rank: int, world: int) -> dict:
    from gpipe_lab.pipeline.distributed import DistributedGPipe

    pipe = DistributedGPipe(bn_model(), options=options(transport="distributed"))
    check_engine(pipe, options(transport="distributed"), batch_norm=rank == 0)  # layer 1 is on rank 0
    return {"threads": torch.get_num_threads(), "device": str(pipe.device), "seed": pipe.seed}


@pytest.mark.distributed
def test_distributed_gpipe_takes_every_option() -> None:
    results = run_local(_distributed_worker, world_size=2, timeout=120, threads=4)
    for r in results:
        assert r.exitcode == 0, r.error
        assert r.value == {"threads": 1, "device": "cpu", "seed": 1234}


class _Built(Exception):
    """Raised once the engine exists: the options are checked without training."""


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[PipelineCore]:
    """Records every engine as it starts, then stops the run."""
    engines: list[PipelineCore] = []
    original = PipelineCore._start_core

    def record(self: PipelineCore, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        engines.append(self)
        raise _Built

    monkeypatch.setattr(PipelineCore, "_start_core", record)
    return engines


def test_strategy_passes_every_option(started: list[PipelineCore], tmp_path: Path) -> None:
    wanted = options(balance=[2, 2, 2, 3], cost=[1.0] * 9)  # TinyRegressor has 9 layers
    fit = trainer(GPipeStrategy(options=wanted), max_steps=1, default_root_dir=str(tmp_path))
    with pytest.raises(_Built):
        fit.fit(TinyRegressor(), TinyData())
    check_engine(started[0], wanted, batch_norm=False)


def test_strategy_hands_every_option_to_the_distributed_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_lab.lightning import engine
    from gpipe_lab.pipeline import distributed

    seen: dict = {}
    monkeypatch.setattr(distributed, "DistributedGPipe", lambda layers, **kw: seen.update(kw))
    engine.build_distributed_engine(nn.Sequential(), options(transport="distributed"), torch.device("cpu"), 1)
    assert seen["options"] == options(transport="distributed")


def override_value(value: object) -> str:
    """``value`` in Hydra's override grammar."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value)


def test_gpipe_train_passes_every_option(started: list[PipelineCore], tmp_path: Path) -> None:
    from gpipe_lab.app.train import build_module, run
    from helpers.app import make_config

    base = ["logger=none", "trainer=smoke", "trainer.max_steps=1", "data.batch_size=8"]
    layers = len(build_module(make_config(*base), datamodule=None).layers)
    balance = [layers // 4] * 3 + [layers - 3 * (layers // 4)]
    wanted = options(balance=balance, cost=[1.0] * layers)
    overrides = [f"pipeline.{k}={override_value(v)}" for k, v in wanted.to_dict().items()]
    with pytest.raises(_Built):
        run(make_config(*base, *overrides, tmp_path=tmp_path))
    check_engine(started[0], wanted)


def test_gpipe_train_times_layers_at_the_micro_batch_size_for_cost_time(started: list[PipelineCore], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_lab.app import train
    from gpipe_lab.app.train import build_module, run
    from helpers.app import make_config

    sizes: list[int] = []
    measured = train.preset_costs

    def spy(model: nn.Sequential, kind: str, *args: object, batch_size: int = 1) -> list[float]:
        sizes.append(batch_size)
        return measured(model, kind, *args, batch_size=batch_size)

    monkeypatch.setattr(train, "preset_costs", spy)
    base = ["logger=none", "trainer=smoke", "trainer.max_steps=1", "data.batch_size=8", "pipeline.chunks=2",
            "pipeline.cost=time", "pipeline.partitions=2"]
    layers = len(build_module(make_config(*base), datamodule=None).layers)
    with pytest.raises(_Built):
        run(make_config(*base, tmp_path=tmp_path))
    cost = started[0].options.cost
    assert sizes == [4] and len(cost) == layers and all(c > 0 for c in cost)
    assert started[0].options.balance == balance_by_cost(cost, 2)

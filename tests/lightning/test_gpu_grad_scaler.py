"""16-mixed under the pipeline: the GradScaler unscales, skips an overflowing step and updates every step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins import MixedPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.lightning.scaling import agreeing_precision, unscale_loss
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


@pytest.fixture
def one_process_group(tmp_path):  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_distributed_scaler_agrees_over_the_processes_and_keeps_the_settings(one_process_group: None) -> None:
    given = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=7))
    plugin = agreeing_precision(given)
    scaler = plugin.scaler
    assert isinstance(scaler, ShardedGradScaler) and scaler.process_group is dist.group.WORLD
    assert (plugin.precision, scaler.get_scale(), scaler.get_growth_interval()) == ("16-mixed", 4.0, 7)
    assert agreeing_precision(plugin) is plugin
    scaler.scale(torch.ones(()))  # the scale tensor is created lazily
    p = torch.nn.Parameter(torch.ones(2))
    idle = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)  # a rank whose stage has no gradient
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([float("inf"), 1.0])
    scaler.unscale_(idle)  # still takes part in the all-reduce (no hang), finds nothing
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 and torch.equal(p.detach(), torch.ones(2))  # skipped, backed off


def test_precision_without_a_scaler_is_kept() -> None:
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert agreeing_precision(plugin) is plugin

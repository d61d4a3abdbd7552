"""One flag goes multi-process: ``pipeline.transport=distributed`` makes the trainer start one
process per stage (``trainer.devices=auto`` follows K; the interleaved schedule's distributed
run is that launch); a device count that K does not divide is refused naming both keys and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpipe_lab.app.config.groups import ConfigError, trainer_devices, validate
from gpipe_lab.app.train import run
from helpers.app import gpipe_train, make_config


@pytest.mark.parametrize(("overrides", "devices"), [
    ((), "auto"),
    (("pipeline.transport=distributed",), 2),
    (("pipeline.transport=distributed", "pipeline.partitions=3"), 3),
    (("pipeline.transport=distributed", "trainer.devices=4"), 4),  # two data-parallel replicas
])
def test_trainer_devices_follow_k_unless_set(overrides, devices) -> None:
    cfg = make_config(*overrides)
    assert trainer_devices(cfg, validate(cfg).options) == devices


def test_a_conflicting_device_count_names_both_keys_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.devices: world size 3 .* pipeline\.partitions=2.*"
                                          r"drop trainer\.devices .* or set trainer\.devices=2"):
        validate(make_config("pipeline.transport=distributed", "trainer.devices=3"))


SMOKE = ["trainer=smoke", "trainer.max_steps=2", "data.num_train=64", "data.num_val=16", "data.batch_size=16",
         "logger=none"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["local", "distributed"])
def test_interleaved_schedule_trains_through_the_app(transport: str, tmp_path: Path) -> None:
    """With ``distributed`` this is also the one-flag run (``gpipe-train pipeline.transport=distributed
    pipeline.partitions=2``, no ``trainer=distributed``): a process per stage trains. The local
    transport runs in this process (the app's ``run``: no start-up to pay)."""
    overrides = [f"pipeline.transport={transport}", "pipeline.partitions=2", "pipeline.schedule=interleaved-1f1b",
                 "pipeline.virtual_stages=2", *SMOKE]
    if transport == "local":
        run(make_config(*overrides, tmp_path=tmp_path))
    else:
        gpipe_train(overrides, tmp_path, timeout=360)
    (summary_path,) = tmp_path.rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert (summary["K"], summary["transport"], summary["schedule"], summary["steps"]) == \
        (2, transport, "interleaved-1f1b", 2)
    assert summary["final_train_loss"] > 0

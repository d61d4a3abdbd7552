"""``callbacks.model_checkpoint.monitor`` keeps ``checkpoints/best.ckpt`` beside ``last.ckpt``: the
checkpoint of the best validation value (max for accuracy and BLEU, min for a loss), on either
transport; a metric the model's validation does not log, or a mode other than max/min, is refused
in one line naming the allowed ones.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from gpipe_lab.app.config.groups import ConfigError, validate
from helpers.app import SMALL, gpipe_train, make_config

#: 2 steps an epoch, validated at each epoch's end: 3 validations in 6 steps
RUN = [*(o for o in SMALL if o != "logger=none"), "logger=csv", "trainer.max_steps=6", "trainer.limit_val_batches=1",
       "trainer.enable_checkpointing=true", "optimizer.lr=0.05"]


def validations(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every validation the CSV logger wrote, in order."""
    (path,) = run_dir.rglob("metrics.csv")
    with open(path) as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


def expected_best(rows: list[tuple[int, float]], mode: str) -> tuple[int, float]:
    """The first validation whose value no later one beats strictly."""
    best = rows[0]
    for row in rows[1:]:
        if (row[1] > best[1]) if mode == "max" else (row[1] < best[1]):
            best = row
    return best


@pytest.mark.parametrize(("monitor", "mode"), [("val/loss", "min"), ("val/acc", "max")])
def test_best_ckpt_is_the_checkpoint_of_the_best_validation(monitor, mode, tmp_path):
    run_dir = tmp_path / "run"
    gpipe_train([*RUN, f"callbacks.model_checkpoint.monitor={monitor}", f"hydra.run.dir={run_dir}"], tmp_path)
    rows = validations(run_dir, monitor)
    assert len(rows) == 3, rows
    step, value = expected_best(rows, mode)
    best = torch.load(run_dir / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=False)
    assert best["callbacks"][f"BestCheckpoint[{monitor}]"]["best"] == pytest.approx(value, rel=1e-6)
    assert best["global_step"] == step + 1  # Lightning logs a validation at the step before the count moves on
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow  # two processes' start-up: about 15 s on two busy cores
@pytest.mark.timeout(400)
def test_the_distributed_transport_keeps_the_best_checkpoint_too(tmp_path):
    run_dir = tmp_path / "run"
    gpipe_train([*RUN, "pipeline.transport=distributed", "callbacks.model_checkpoint.monitor=val/loss",
                 f"hydra.run.dir={run_dir}"], tmp_path, timeout=360)
    step, value = expected_best(validations(run_dir, "val/loss"), "min")
    best = torch.load(run_dir / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=False)
    assert (best["global_step"], best["callbacks"]["BestCheckpoint[val/loss]"]["best"]) == \
        (step + 1, pytest.approx(value, rel=1e-6))
    assert best["state_dict"].keys() == torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                                                   weights_only=False)["state_dict"].keys()


def test_a_metric_the_validation_does_not_log_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"callbacks.model_checkpoint.monitor: 'val/bleu' is not logged by "
                                          r"amoebanet_d_tiny's validation; allowed: val/loss, val/acc"):
        validate(make_config("callbacks.model_checkpoint.monitor=val/bleu"))
    validate(make_config("experiment=transformer_tiny", "callbacks.model_checkpoint.monitor=val/bleu"))
    with pytest.raises(ConfigError, match="callbacks.model_checkpoint.mode: 'best' is not max, min or null"):
        validate(make_config("callbacks.model_checkpoint.monitor=val/acc", "callbacks.model_checkpoint.mode=best"))

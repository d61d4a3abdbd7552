"""Resume and fine-tuning without traps: a wrong resume fails in one line that says what to run.

A finished run without a larger ``trainer.max_steps``, another optimizer, another model (the
differing keys named), ``init_from``'s fresh classifier, and ``experiment=transfer_synthetic``
using its ``transfer`` keys. Ctrl-C's summary, last picture and resume command are checked by
``test_reliability_app.py``'s SIGINT test, on the same kind of interrupted run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gpipe_lab.app.config.groups import ConfigError, validate
from gpipe_lab.app.train import cli, run
from helpers.app import gpipe_train, make_config

SMALL = ["trainer=smoke", "logger=none", "data.num_train=16", "data.num_val=8", "data.batch_size=8",
         "model.num_filters=8", "data.image_size=8", "model.image_size=8", "trainer.enable_checkpointing=true"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """``last.ckpt`` of a finished 2-step run (Adam), with Hydra's saved config next to it: the
    console script's ``cli`` run in this process, as ``gpipe-train`` runs it."""
    tmp = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        patch.delenv("HYDRA_FULL_ERROR", raising=False)
        patch.setattr(sys, "argv", ["gpipe-train", *SMALL, "trainer.max_steps=2", f"paths.log_dir={tmp}"])
        try:
            cli()
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
    return next(tmp.glob("train/runs/*/checkpoints/last.ckpt"))


def resume(ckpt: Path, tmp_path: Path, *overrides: str) -> None:
    run(make_config(*SMALL, f"ckpt_path={ckpt}", *overrides, tmp_path=tmp_path))


def test_resuming_a_finished_run_says_so_and_how_to_continue(finished, tmp_path):
    with pytest.raises(ConfigError, match="at step 2, which already reaches trainer.max_steps=2.*"
                                          "trainer.max_steps=4"):
        resume(finished, tmp_path, "trainer.max_steps=2")


def test_another_optimizer_names_both_and_offers_init_from(finished, tmp_path):
    with pytest.raises(ConfigError, match="uses 'sgd' but the checkpoint .* holds the state of 'adam'; "
                                          "resume with optimizer=adam, or .* init_from="):
        resume(finished, tmp_path, "optimizer=sgd", "trainer.max_steps=4")


def test_another_optimizer_without_a_saved_config_is_found_from_the_state(finished, tmp_path):
    bare = tmp_path / "bare" / "last.ckpt"
    bare.parent.mkdir()
    bare.write_bytes(finished.read_bytes())  # no .hydra/config.yaml two levels up
    with pytest.raises(ConfigError, match="holds the state of 'adam'"):
        resume(bare, tmp_path, "optimizer=sgd", "trainer.max_steps=4")


def test_another_model_names_the_differing_keys_not_the_state_dict(finished, tmp_path):
    with pytest.raises(ConfigError) as info:
        resume(finished, tmp_path, "model.num_filters=16", "trainer.max_steps=4")
    message = str(info.value)
    assert "model.num_filters: checkpoint 8, this run 16" in message and len(message) < 600


def test_another_model_without_a_saved_config_names_checkpoint_and_model_shapes(finished, tmp_path):
    bare = tmp_path / "bare" / "last.ckpt"
    bare.parent.mkdir()
    bare.write_bytes(finished.read_bytes())
    with pytest.raises(ConfigError, match=r"weight\(s\) of the checkpoint do not fit .*: checkpoint \(.*\) vs model"):
        resume(bare, tmp_path, "model.num_filters=16", "trainer.max_steps=4")


def test_init_from_starts_a_fresh_classifier_unless_asked_to_keep_it(finished):
    from gpipe_lab.app.train import build_datamodule, build_module
    from gpipe_lab.lightning.init_from import load_initial_weights

    cfg = make_config(*SMALL)
    saved = torch.load(finished, map_location="cpu", weights_only=False)["state_dict"]
    for fresh in (True, False):
        module = build_module(cfg, build_datamodule(cfg))
        left = load_initial_weights(module, finished, fresh_classifier=fresh)
        assert bool(left) == fresh and all(k.startswith("layers.classifier") for k in left)
        weight = "layers.classifier.fc.weight"
        assert torch.equal(module.state_dict()[weight], saved[weight]) is not fresh


def test_init_from_shape_mismatch_names_model_and_checkpoint(finished):
    from gpipe_lab.app.train import build_datamodule, build_module
    from gpipe_lab.lightning.init_from import load_initial_weights

    cfg = make_config(*[o for o in SMALL if "num_filters" not in o], "model.num_filters=16")
    module = build_module(cfg, build_datamodule(cfg))
    with pytest.raises(RuntimeError, match=r": model \(.*\) vs checkpoint \("):
        load_initial_weights(module, finished)


def test_transfer_synthetic_uses_its_lr_steps_flips_and_cutout():
    cfg = make_config("experiment=transfer_synthetic")
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.trainer.max_steps) == ("sgd", cfg.transfer.lr, cfg.transfer.steps)
    assert cfg.data.random_flip and cfg.data.cutout == 8
    validate(cfg)
    with pytest.raises(ConfigError, match="transfer.cutout: only experiments/transfer.py's loop"):
        validate(make_config("experiment=transfer_synthetic", "transfer.cutout=8"))


def test_synthetic_augmentation_flips_and_cuts_only_training_images():
    from gpipe_lab.data import build_datamodule

    plain = build_datamodule("synthetic_images", num_train=8, num_val=8)
    aug = build_datamodule("synthetic_images", num_train=8, num_val=8, random_flip=True, cutout=8)
    torch.manual_seed(0)
    changed = [not torch.equal(plain.train_set[i][0], aug.train_set[i][0]) for i in range(8)]
    assert all(changed)  # the cutout square at least
    assert torch.equal(plain.val_set[0][0], aug.val_set[0][0])


@pytest.mark.slow
def test_ckpt_path_last_continues_the_run_with_its_overrides_and_wandb_run(tmp_path):
    from gpipe_lab.app.continuation import wandb_run_id

    small = [o for o in SMALL if o != "logger=none"]
    first = tmp_path / "train" / "runs" / "first"  # its own folder: the timestamped one is per second
    gpipe_train([*small, "logger=wandb", "trainer.max_steps=2", f"hydra.run.dir={first}"], tmp_path)
    proc = gpipe_train(["ckpt_path=last", "trainer.max_steps=4"], tmp_path)  # nothing else retyped
    second = next(p for p in tmp_path.glob("train/runs/*") if p != first)
    assert (second / "resumed_run").resolve() == first.resolve()
    assert "continuing run" in proc.stdout
    summary = json.loads((second / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"] == str(first / "checkpoints" / "last.ckpt")
    assert wandb_run_id(second) == wandb_run_id(first) is not None

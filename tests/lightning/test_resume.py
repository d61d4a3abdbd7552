"""Resume in-process (fast): the resumable loader, ``ResumableCheckpoint`` at batch ends,
global RNG and dropout generators, Ctrl-C, ``ckpt_path=last`` and ``init_from``.

The subprocess versions (the real app, SIGKILL and SIGINT) are in ``test_reliability_app.py``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from gpipe_lab.app.config.groups import ConfigError
from gpipe_lab.app.config.groups import validate as validate_config
from gpipe_lab.app.train import run
from gpipe_lab.data import TokenBucketBatchSampler
from gpipe_lab.data.image_datamodule import EpochRandomSampler
from gpipe_lab.data.resumable import ResumableDataLoader
from gpipe_lab.lightning import GPipeStrategy, PipelineModule
from gpipe_lab.lightning.resume import ResumableCheckpoint, load_initial_weights, resolve_ckpt_path
from helpers.app import make_config

STEPS_PER_EPOCH = 4


class NoisyData(Dataset):
    """Regression samples plus noise from the GLOBAL torch RNG (drawn in the main thread)."""

    def __init__(self, n: int = 8 * STEPS_PER_EPOCH) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :1] * 0.5 - self.x[:, 1:2] ** 2 * 0.3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.01 * torch.randn(8), self.y[i]


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.data = NoisyData()

    def train_dataloader(self) -> DataLoader:
        loader = ResumableDataLoader(self.data, batch_size=8, sampler=EpochRandomSampler(self.data, seed=5),
                                     drop_last=True)
        loader.seed = 5
        return loader

    def val_dataloader(self) -> DataLoader:  # no global RNG: neither noise nor the iterator's seed
        x, y = self.data.x[:16], self.data.y[:16]
        return DataLoader(TensorDataset(x, y), batch_size=8, generator=torch.Generator().manual_seed(0))


class DropoutRegressor(PipelineModule):
    """An MLP with dropout (masks from the pipeline's per-(step, stage, micro-batch) generators)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(),
                                    nn.Dropout(0.3), nn.Linear(16, 1))
        self.losses: dict[int, float] = {}

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs.float(), targets)

    def log_train(self, loss: torch.Tensor, outputs: object, targets: object) -> None:
        self.losses[self.trainer.fit_loop.total_batch_idx] = float(loss)
        super().log_train(loss, outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fit(ckpt_dir: Path, max_steps: int, ckpt_path: Path | None = None, validate: bool = False,
        accumulate: int = 1, every: int | None = None, callbacks: tuple = ()) -> DropoutRegressor:
    module = DropoutRegressor()
    if ckpt_path is not None:
        module.layers[0].weight.data.zero_()  # must come from the checkpoint
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=2 if validate else 0, max_steps=max_steps,
        accumulate_grad_batches=accumulate, strategy=GPipeStrategy(partitions=2, chunks=2, seed=7, threads_per_stage=1),
        callbacks=[ResumableCheckpoint(ckpt_dir, every_n_train_steps=every, save_top_k=-1), *callbacks])
    torch.manual_seed(123)  # the global RNG differs between runs unless the checkpoint restores it
    torch.randn(int(ckpt_path is not None) + 1)
    trainer.fit(module, Data(), ckpt_path=str(ckpt_path) if ckpt_path else None)
    return module


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[tuple[bool, int], dict[int, float]]:
    out = {}
    for validate, accumulate in ((False, 1), (True, 1), (False, 2)):
        module = fit(tmp_path_factory.mktemp("ref"), 10, validate=validate, accumulate=accumulate)
        assert sorted(module.losses) == list(range(10 * accumulate))
        out[(validate, accumulate)] = module.losses
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stop", "validate", "accumulate"), [
    (3, False, 1),  # mid-epoch
    (4, False, 1),  # the last batch of an epoch (Lightning 2.6's epoch-end trouble)
    (4, True, 1),  # the same with validation at the epoch end
    (6, True, 1),  # mid-epoch, after a validation
    (3, False, 2),  # accumulation: 6 batches, mid second epoch
], ids=["mid-epoch", "epoch-end", "epoch-end-validated", "mid-epoch-validated", "accumulate"])
def test_stop_then_resume_is_bitwise_the_uninterrupted_run(references, tmp_path, stop, validate, accumulate):
    reference = references[(validate, accumulate)]
    first = fit(tmp_path, stop, validate=validate, accumulate=accumulate)
    last = tmp_path / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == stop
    resumed = fit(tmp_path / "resumed", 10, ckpt_path=last, validate=validate, accumulate=accumulate)
    batches = stop * accumulate
    assert sorted(first.losses) == list(range(batches))
    assert sorted(resumed.losses) == list(range(batches, 10 * accumulate)), resumed.losses
    assert {**first.losses, **resumed.losses} == reference  # float equality of every batch's loss


@pytest.mark.timeout(120)
def test_periodic_checkpoints_are_batch_end_states_that_resume(references, tmp_path):
    fit(tmp_path, 10, every=3)
    names = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert names == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=10.ckpt", "epoch=2-step=9.ckpt",
                     "last.ckpt"], names
    assert not list(tmp_path.glob("*.partial"))
    resumed = fit(tmp_path / "resumed", 10, ckpt_path=tmp_path / "epoch=1-step=6.ckpt")
    assert resumed.losses == {s: v for s, v in references[(False, 1)].items() if s >= 6}


class CtrlCAt(pl.Callback):
    """Sends this process SIGINT during training step ``step`` (as a terminal's Ctrl-C would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.timeout(120)
def test_ctrl_c_finishes_the_step_writes_last_ckpt_and_exits_1(references, tmp_path, capsys):
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:
            fit(tmp_path, 10, callbacks=(CtrlCAt(5),))
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning leaves SIGINT ignored after a KeyboardInterrupt
    assert stopped.value.code == 1
    assert "Ctrl-C: stopping after the current step" in capsys.readouterr().err
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6  # step 5 finished
    resumed = fit(tmp_path / "resumed", 10, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.losses == {s: v for s, v in references[(False, 1)].items() if s >= 6}


def test_loader_state_continues_at_the_next_batch() -> None:
    data = NoisyData()

    def loader() -> ResumableDataLoader:
        return ResumableDataLoader(data, batch_size=8, sampler=EpochRandomSampler(data, seed=2), drop_last=True)

    def order(batches: list) -> list[list[float]]:
        return [b[1].flatten().tolist() for b in batches]

    full = loader()
    full.sampler.set_epoch(3)
    every = order(list(full))
    partial = loader()
    partial.sampler.set_epoch(3)
    it = iter(partial)
    head = [next(it), next(it)]
    assert partial.state_dict() == {"epoch": 3, "batches": 2}
    again = loader()
    again.load_state_dict(partial.state_dict())
    assert order(head) + order(list(again)) == every
    assert again.state_dict() == {"epoch": 3, "batches": STEPS_PER_EPOCH}
    after = loader()
    after.load_state_dict(again.state_dict())  # an epoch end: the next epoch from its start
    assert after.sampler.epoch == 4 and after.state_dict() == {"epoch": 4, "batches": 0}
    assert len(list(after)) == STEPS_PER_EPOCH


def test_token_bucket_loader_resumes_too() -> None:
    sizes = [3 + (i * 7) % 11 for i in range(40)]
    sampler = TokenBucketBatchSampler(sizes, tokens_per_batch=40, seed=1)
    full = ResumableDataLoader(list(range(40)), batch_sampler=sampler, collate_fn=list)
    sampler.set_epoch(2)
    every = list(full)
    other = TokenBucketBatchSampler(sizes, tokens_per_batch=40, seed=1)
    resumed = ResumableDataLoader(list(range(40)), batch_sampler=other, collate_fn=list)
    resumed.load_state_dict({"epoch": 2, "batches": 3})
    assert list(resumed) == every[3:]


def test_ckpt_path_last(tmp_path) -> None:
    runs = tmp_path / "runs"
    assert resolve_ckpt_path(None, tmp_path / "new", runs) is None
    assert resolve_ckpt_path("/x/epoch=1-step=8.ckpt", tmp_path / "new", runs) == "/x/epoch=1-step=8.ckpt"
    with pytest.raises(FileNotFoundError, match="ckpt_path=last"):
        resolve_ckpt_path("last", tmp_path / "new", runs)
    for i, name in enumerate(("old", "newer")):
        (runs / name / "checkpoints").mkdir(parents=True)
        (runs / name / "checkpoints" / "last.ckpt").write_bytes(b"x")
        os.utime(runs / name / "checkpoints" / "last.ckpt", (1000 + i, 1000 + i))
    assert resolve_ckpt_path("last", runs / "new", runs) == str(runs / "newer" / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path("last", runs / "old", runs) == str(runs / "old" / "checkpoints" / "last.ckpt")


def test_init_from_keeps_all_but_the_classifier(tmp_path) -> None:
    from gpipe_lab.lightning.modules import ImageClassifier
    from gpipe_lab.models import build

    def classifier(classes: int, seed: int) -> ImageClassifier:
        torch.manual_seed(seed)
        return ImageClassifier(build("amoebanet_d_tiny", num_filters=8, image_size=8, num_classes=classes))

    source = classifier(10, 0)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "a.ckpt")
    torch.save(source.layers.state_dict(), tmp_path / "plain.pt")  # a bare nn.Sequential state dict
    for path in (tmp_path / "a.ckpt", tmp_path / "plain.pt"):
        target = classifier(5, 1)
        fresh = load_initial_weights(target, path)
        assert fresh == ["layers.classifier.fc.bias", "layers.classifier.fc.weight"]
        for key, value in target.state_dict().items():
            assert torch.equal(value, source.state_dict()[key]) != (key in fresh), key
    other = ImageClassifier(build("amoebanet_d_tiny", num_filters=16, image_size=8, num_classes=5))
    with pytest.raises(RuntimeError, match="outside its last layer"):
        load_initial_weights(other, tmp_path / "a.ckpt")
    with pytest.raises(FileNotFoundError, match="init_from"):
        load_initial_weights(other, tmp_path / "missing.ckpt")


@pytest.mark.timeout(180)
def test_transfer_experiment_fine_tunes_through_the_app(tmp_path, capsys) -> None:
    """``gpipe-train experiment=transfer_synthetic``: pretrain 2 steps on 10 classes, then fine-tune
    from that checkpoint (``transfer.checkpoint``, i.e. ``init_from``) on 5 other classes."""
    small = ["experiment=transfer_synthetic", "trainer=smoke", "logger=none", "trainer.max_steps=2",
             "trainer.limit_val_batches=1", "data.num_train=32", "data.num_val=8", "data.batch_size=8",
             "model.num_filters=8", "data.image_size=8", "model.image_size=8"]
    run(make_config(*small, "data.class_offset=0", "trainer.enable_checkpointing=true", tmp_path=tmp_path / "pre"))
    ckpt = tmp_path / "pre" / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2
    summary = run(make_config(*small, "data.num_classes=5", f"transfer.checkpoint='{ckpt}'", tmp_path=tmp_path / "t"))
    assert summary["steps"] == 2 and summary["init_from"] == str(ckpt)
    assert "loaded every weight but 2 new one(s)" in capsys.readouterr().out
    summary = run(make_config(*small, "data.num_classes=3", f"init_from='{ckpt}'", tmp_path=tmp_path / "i"))
    assert summary["steps"] == 2 and summary["init_from"] == str(ckpt)


@pytest.mark.parametrize(("override", "key"), [
    ("callbacks.checkpoint_every_n_steps=-1", "callbacks.checkpoint_every_n_steps"),
    ("callbacks.checkpoint_every_n_steps=often", "callbacks.checkpoint_every_n_steps"),
    ("callbacks.keep_checkpoints=-2", "callbacks.keep_checkpoints"),
    ("+callbacks.keep_best=3", "callbacks.keep_best"),
    ("init_from=/x.ckpt", "init_from"),  # with ckpt_path below: one or the other
])
def test_bad_callbacks_and_resume_configs_name_the_key(override: str, key: str) -> None:
    extra = ["ckpt_path=/y.ckpt"] if key == "init_from" else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(make_config(override, *extra))

"""The datamodules run under a Lightning Trainer: loaders, epochs (set_epoch) and replica lookup."""

import lightning.pytorch as pl
import torch
import torch.nn as nn

from gpipe_lab.data import build_datamodule


class _Probe(pl.LightningModule):
    """Counts batches; a linear layer on a summary of the batch so there is something to optimize."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch[0], torch.Tensor) else batch[0][0]
        self.seen.append(tuple(x.shape))
        return self.layer(x.float().mean().reshape(1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(dm, epochs=2, batches=3):
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, limit_train_batches=batches, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    probe = _Probe()
    trainer.fit(probe, datamodule=dm)
    return probe, trainer


def test_images_under_trainer():
    probe, _ = _fit(build_datamodule("synthetic_images", batch_size=4, num_train=40, num_val=8))
    assert probe.seen == [(4, 3, 32, 32)] * 6


def test_translation_under_trainer_gets_a_new_order_each_epoch():
    dm = build_datamodule("synthetic_translation", tokens_per_batch=64, num_train=200, num_val=10)
    probe, trainer = _fit(dm, epochs=2, batches=50)
    assert dm._replica() == (0, 1)  # single process: one replica
    per_epoch = len(probe.seen) // 2
    assert per_epoch == len(dm.train_dataloader()) and probe.seen[:per_epoch] != probe.seen[per_epoch:]


def test_lightning_distributed_sampler_injection_sets_the_replica():
    """What a distributed Trainer does to a loader (use_distributed_sampler=True), run in one process."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler, DistributedSampler

    dm = build_datamodule("synthetic_translation", tokens_per_batch=64, num_train=200, num_val=10)
    with _replace_dunder_methods(BatchSampler):  # Lightning records the batch sampler's arguments
        loader = dm.train_dataloader()
    shards = []
    for rank in range(2):
        injected = DistributedSampler(dm.train_set, num_replicas=2, rank=rank, shuffle=True)
        new = _update_dataloader(loader, injected, mode=RunningStage.TRAINING)
        assert (new.batch_sampler.rank, new.batch_sampler.world_size) == (rank, 2)
        assert new.batch_sampler.tokens_per_batch == 64
        shards.append([i for batch in new.batch_sampler for i in batch])
    assert len(set(shards[0]) | set(shards[1])) == 200

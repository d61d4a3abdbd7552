"""Tiny models and data shared by the strategy tests (no engineer's presets needed)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpipe_lab.lightning import PipelineModule


def tiny_layers(width: int = 16) -> nn.Sequential:
    """The 8-layer MLP of ``TinyRegressor`` (weights from the current generator)."""
    blocks: list[nn.Module] = [nn.Linear(8, width)]
    for _ in range(3):
        blocks += [nn.Tanh(), nn.Linear(width, width)]
    blocks += [nn.Tanh(), nn.Linear(width, 1)]
    return nn.Sequential(*blocks)


class TinyRegressor(PipelineModule):
    """An 8-layer MLP regression task; ``manual=True`` uses manual optimization."""

    def __init__(self, manual: bool = False, lr: float = 0.05, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = tiny_layers(width)
        self.width = width
        self.automatic_optimization = not manual
        self.lr = lr
        self.losses: list[float] = []

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs.float(), targets)

    def log_train(self, loss: torch.Tensor, outputs: object, targets: object) -> None:
        self.losses.append(float(loss))
        super().log_train(loss, outputs, targets)
        if isinstance(outputs, torch.Tensor):  # only the last stage has them in distributed runs
            self.log("train/output_mean", outputs.float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class MetaRegressor(TinyRegressor):
    """``TinyRegressor`` whose layers are built in ``configure_model`` (on ``meta`` under a
    ``GPipeStrategy``); ``built_on`` records the device they were created on."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        del self.layers
        self.built_on: torch.device | None = None

    def configure_model(self) -> None:
        if getattr(self, "layers", None) is None:
            self.layers = tiny_layers(self.width)
            self.built_on = self.layers[0].weight.device


class TinyData(pl.LightningDataModule):
    """Deterministic regression data; the order depends only on the epoch (resumable)."""

    def __init__(self, batch_size: int = 16, n: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n, 8, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] ** 2 * 0.3
        self.data = TensorDataset(x, y)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.data, num_replicas=1, rank=0, shuffle=True, seed=3)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class RecordMetric(pl.Callback):
    """The value of ``key`` the trainer holds after each training batch (``None`` if absent)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.values: list[float | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        value = trainer.callback_metrics.get(self.key)
        self.values.append(None if value is None else float(value))


def trainer(strategy: object = "auto", **kwargs: object) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0)
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)  # type: ignore[arg-type]

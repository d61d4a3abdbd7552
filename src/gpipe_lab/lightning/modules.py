"""The LightningModules of the two task families: image classification and translation.

Both are plain ``PipelineModule``s: a layer sequence from ``gpipe_lab.models.build``,
a loss, metrics and an optimizer; no micro-batches anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.lightning.pipeline_module import PipelineModule

OPTIMIZERS = ("sgd", "adam", "adamw")

#: An optimizer factory (``hydra.utils.instantiate`` of ``conf/optimizer/``), or
#: ``make_optimizer``'s keyword arguments.
OptimizerSpec = Union[Callable[[Iterable[Any]], torch.optim.Optimizer], dict[str, Any], None]


def make_optimizer(params: Any, name: str = "adam", lr: float = 0.003, momentum: float = 0.9,
                   weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.98)) -> torch.optim.Optimizer:
    """``adam`` (the default), ``adamw`` or ``sgd`` (with ``momentum``, nesterov off).

    The defaults are ``conf/optimizer/adam.yaml``'s. ``momentum`` is used by ``sgd`` only,
    ``betas`` by the Adam family only.

    Raises:
        ValueError: unknown optimizer name.
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay)
    raise ValueError(f"optimizer.name must be one of {list(OPTIMIZERS)}, got {name!r}")


class _WithOptimizer(PipelineModule):
    """A ``PipelineModule`` trained with the optimizer its ``optimizer_spec`` names."""

    optimizer_spec: OptimizerSpec

    def configure_optimizers(self) -> torch.optim.Optimizer:
        spec = self.optimizer_spec
        params = self.parameters()
        return spec(params) if callable(spec) else make_optimizer(params, **(spec or {}))


class ImageClassifier(_WithOptimizer):
    """Cross-entropy classification of images; logs loss and top-1 accuracy."""

    #: what validation logs (a best checkpoint's ``callbacks.model_checkpoint.monitor`` is one of them)
    VALIDATION_METRICS = ("val/loss", "val/acc")

    def __init__(self, layers: nn.Sequential, optimizer: OptimizerSpec = None,
                 label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.layers = layers
        self.optimizer_spec = optimizer
        self.label_smoothing = label_smoothing

    def loss_fn(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(outputs.float(), targets, label_smoothing=self.label_smoothing)

    def log_train(self, loss: Tensor, outputs: Any, targets: Any) -> None:
        self.log("train/loss", loss, prog_bar=True)
        if outputs is not None:
            acc = (outputs.argmax(-1) == targets.to(outputs.device)).float().mean()
            self.log("train/acc", acc, prog_bar=True)

    def evaluate(self, batch: Any, prefix: str) -> dict[str, Tensor]:
        result = super().evaluate(batch, prefix)
        acc = (result["outputs"].argmax(-1) == result["targets"]).float().mean()
        self.log(f"{prefix}/acc", acc, prog_bar=prefix == "val")
        return result


class Translator(_WithOptimizer):
    """Token cross-entropy over non-PAD targets (exact per-token mean across micro-batches).

    Validation logs the loss, the token accuracy and corpus BLEU (sacrebleu) of greedy
    decoding on the first ``bleu_batches`` validation batches; a test, the same over every
    test batch (``test/bleu``).
    """

    VALIDATION_METRICS = ("val/loss", "val/token_acc", "val/bleu")

    def __init__(self, layers: nn.Sequential, optimizer: OptimizerSpec = None,
                 label_smoothing: float = 0.0, bleu_batches: int = 2, max_decode_len: int = 32) -> None:
        super().__init__()
        from gpipe_lab.models import count_tokens, translation_loss

        self.layers = layers
        self.optimizer_spec = optimizer
        self._sum_loss = translation_loss(label_smoothing, reduction="sum")
        self.loss_normalizer = count_tokens
        self.bleu_batches = bleu_batches
        self.max_decode_len = max_decode_len
        self._hyps: list[str] = []
        self._refs: list[str] = []

    def loss_fn(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return self._sum_loss(outputs, targets)

    def count_samples(self, inputs: Any, targets: Any) -> tuple[int, Tensor]:
        # the token count stays on the targets' device: read per step, it would be a second sync
        from gpipe_lab.models import count_tokens  # this module's loss_normalizer

        return int(inputs[0].shape[0]), count_tokens(targets).detach()

    def on_validation_epoch_start(self) -> None:
        self._hyps, self._refs = [], []

    def on_test_epoch_start(self) -> None:
        self._hyps, self._refs = [], []

    def evaluate(self, batch: Any, prefix: str) -> dict[str, Tensor]:
        result = super().evaluate(batch, prefix)
        targets = result["targets"]
        mask = targets != 0
        correct = ((result["outputs"].argmax(-1) == targets) & mask).sum()
        self.log(f"{prefix}/token_acc", correct.float() / mask.sum().clamp(min=1))
        return result

    def _translate(self, batch: Any, batch_idx: int, split: str) -> None:
        """Greedy-decode ``batch`` and keep its hypotheses and references for the split's BLEU."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "batch_references"):
            return
        from gpipe_lab.models import greedy_decode

        (src, _), _ = batch
        hyps = greedy_decode(lambda s, t: self((s, t)), src, self.max_decode_len)
        self._hyps += [datamodule.decode(h.tolist()) for h in hyps]
        self._refs += datamodule.batch_references(split)[batch_idx]

    def _log_bleu(self, prefix: str) -> None:
        if self._hyps:
            from gpipe_lab.data import corpus_bleu

            score = corpus_bleu(self._hyps, self._refs[: len(self._hyps)])
            self.log(f"{prefix}/bleu", float(score.score), prog_bar=prefix == "val")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.evaluate(batch, "val")["loss"]
        if batch_idx < self.bleu_batches:
            self._translate(batch, batch_idx, "val")
        return loss

    def on_validation_epoch_end(self) -> None:
        self._log_bleu("val")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.evaluate(batch, "test")["loss"]
        self._translate(batch, batch_idx, "test")
        return loss

    def on_test_epoch_end(self) -> None:
        self._log_bleu("test")

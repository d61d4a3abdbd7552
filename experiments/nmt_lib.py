"""A small translation training run on the built-in synthetic language pair, through gpipe-train's path.

``train_translation`` trains an encoder-decoder Transformer (``models.build``
preset ``transformer_tiny`` with overrides) the way ``gpipe-train`` does: the
``Translator`` LightningModule under a ``GPipeStrategy`` (K CPU stages, local
transport) and a Lightning ``Trainer``. A callback records the loss, the gradient
norm and whether the step was non-finite (the strategy skips those optimizer steps,
``nonfinite="skip"``); at the end the validation NLL (token mean, no label
smoothing) and greedy-decoding BLEU (sacrebleu) are computed on the trained layers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from gpipe_lab.data import SyntheticTranslationDataModule, corpus_bleu
from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.lightning.modules import Translator
from gpipe_lab.models import build, count_tokens, greedy_decode, token_cross_entropy


@dataclass
class RunResult:
    """What one training run measured."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    max_logits: list[float] = field(default_factory=list)
    nonfinite_steps: int = 0
    val_nll: float = float("nan")
    bleu: float = float("nan")
    params: int = 0
    tokens_per_step: float = 0.0
    seconds: float = 0.0


class WarmupTranslator(Translator):
    """``Translator`` whose learning rate rises linearly over the first ``warmup`` optimizer steps."""

    def __init__(self, layers: torch.nn.Sequential, optimizer: dict[str, Any], label_smoothing: float,
                 warmup: int) -> None:
        super().__init__(layers, optimizer, label_smoothing=label_smoothing)
        self.warmup = warmup

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if not self.warmup:
            return optimizer
        warmup = self.warmup
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StepRecorder(pl.Callback):
    """Appends each training step's loss, gradient norm, largest |logit| and token count to a ``RunResult``.

    ``peak`` is a one-element list the output projection's hook raises to the step's largest
    unclipped logit magnitude; the recorder reads and resets it after every step.
    """

    def __init__(self, result: RunResult, peak: list[float] | None = None) -> None:
        self.result = result
        self.tokens = 0
        self.peak = peak if peak is not None else [0.0]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = float(trainer.callback_metrics["train/loss"])
        grads = [p.grad.detach().float() for p in pl_module.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.result.nonfinite_steps += 1
        self.result.losses.append(loss)
        self.result.grad_norms.append(norm)
        self.result.max_logits.append(self.peak[0])
        self.peak[0] = 0.0
        self.tokens += int(count_tokens(batch[1]))


def make_data(seed: int, tokens_per_batch: int | None, batch_size: int | None, num_train: int,
              num_val: int) -> SyntheticTranslationDataModule:
    """The synthetic language pair with token-budget (or fixed-size) batches."""
    return SyntheticTranslationDataModule(tokens_per_batch=tokens_per_batch, batch_size=batch_size, seed=seed,
                                          num_train=num_train, num_val=num_val)


def evaluate(model: torch.nn.Module, data: SyntheticTranslationDataModule, max_batches: int = 4) -> tuple[float, float]:
    """(validation NLL per token, BLEU of greedy decoding) on the first ``max_batches`` batches."""
    model.eval()
    nll, tokens, hyps, refs = 0.0, 0, [], []
    references = data.batch_references("val")
    with torch.no_grad():
        for i, ((src, tgt_in), tgt_out) in enumerate(data.val_dataloader()):
            if i >= max_batches:
                break
            nll += float(token_cross_entropy(model((src, tgt_in)), tgt_out, reduction="sum"))
            tokens += int(count_tokens(tgt_out))
            out = greedy_decode(lambda s, t: model((s, t)), src, max_len=tgt_out.shape[1] + 2)
            hyps += [data.decode(row.tolist()) for row in out]
            refs += references[i]
    model.train()
    return nll / max(tokens, 1), float(corpus_bleu(hyps, refs).score)


def train_translation(steps: int, seed: int = 0, lr: float = 1e-3, warmup: int = 0,
                      tokens_per_batch: int | None = None, batch_size: int | None = 32, num_train: int = 4000,
                      num_val: int = 128, partitions: int = 2, chunks: int = 2, eval_batches: int = 4,
                      precision: str = "32-true", **model: object) -> RunResult:
    """Train ``transformer_tiny`` with ``model`` overrides for ``steps`` optimizer steps (Adam, betas 0.9/0.98).

    ``precision`` is Lightning's (``"bf16-mixed"``: the stages run under bfloat16 autocast, as
    the paper trained).

    Non-finite losses or gradients skip the update (counted in ``nonfinite_steps``).

    Raises:
        ValueError: invalid model overrides (from ``models.build``) or pipeline settings (from the strategy).
    """
    torch.set_num_threads(1)  # two intra-op threads per process thrash on a shared 2-core machine
    data = make_data(seed, tokens_per_batch, batch_size, num_train, num_val)
    torch.manual_seed(seed)
    net = build("transformer_tiny", "cpu", vocab_size=data.vocab_size, **model)
    module = WarmupTranslator(net, {"name": "adam", "lr": lr, "betas": (0.9, 0.98)},
                              float(model.get("label_smoothing", 0.0)), warmup)
    result = RunResult(params=sum(p.numel() for p in net.parameters()))
    peak = [0.0]
    head = net[-1]
    projection = getattr(head, "proj", head)  # the raw logits, before any clipping

    def record_peak(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # one count per micro-batch: skip checkpoint replays' no-grad twin
            peak[0] = max(peak[0], float(output.detach().abs().max()))

    projection.register_forward_hook(record_peak)
    recorder = StepRecorder(result, peak)
    strategy = GPipeStrategy(partitions=partitions, chunks=chunks, seed=seed, threads_per_stage=1,
                             nonfinite="skip")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                         max_epochs=-1,
                         limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    result.tokens_per_step = recorder.tokens / max(len(result.losses), 1)
    result.val_nll, result.bleu = evaluate(net, data, eval_batches)
    result.seconds = time.perf_counter() - start
    return result


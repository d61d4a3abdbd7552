"""A small translation training loop on the built-in synthetic language pair, through GPipe.

``train_translation`` trains an encoder-decoder Transformer (``models.build``
preset ``transformer_tiny`` with overrides) with the engine (K=2 CPU stages),
records the loss, the gradient norm and non-finite steps of every step, and
evaluates validation NLL (token mean, no label smoothing) and greedy-decoding
BLEU (sacrebleu) at the end.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from gpipe_lab.data import SyntheticTranslationDataModule, corpus_bleu
from gpipe_lab.models import build, count_tokens, greedy_decode, token_cross_entropy, translation_loss
from gpipe_lab.pipeline import GPipe


@dataclass
class RunResult:
    """What one training run measured."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    nonfinite_steps: int = 0
    val_nll: float = float("nan")
    bleu: float = float("nan")
    params: int = 0
    tokens_per_step: float = 0.0
    seconds: float = 0.0


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
                      **model: object) -> RunResult:
    """Train ``transformer_tiny`` with ``model`` overrides for ``steps`` optimizer steps.

    Non-finite losses or gradients skip the update (counted in ``nonfinite_steps``).

    Raises:
        ValueError: invalid model overrides (from ``models.build``).
    """
    torch.set_num_threads(1)  # two intra-op threads thrash on a shared 2-core machine (80x slower seen)
    data = make_data(seed, tokens_per_batch, batch_size, num_train, num_val)
    torch.manual_seed(seed)
    net = build("transformer_tiny", "cpu", vocab_size=data.vocab_size, **model)
    pipe = GPipe(net, partitions=partitions, chunks=chunks, seed=seed, threads_per_stage=1)
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    loss_fn = translation_loss(float(model.get("label_smoothing", 0.0)), "sum")
    result = RunResult(params=sum(p.numel() for p in net.parameters()))
    start, done, seen_tokens = time.perf_counter(), 0, 0
    while done < steps:
        for (src, tgt_in), tgt_out in data.train_dataloader():
            if done >= steps:
                break
            loss = pipe.train_step((src, tgt_in), tgt_out, loss_fn, loss_normalizer=count_tokens)
            norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf")))
            finite = math.isfinite(float(loss)) and math.isfinite(norm)
            if finite:
                opt.step()
            else:
                result.nonfinite_steps += 1
            opt.zero_grad(set_to_none=True)
            sched.step()
            result.losses.append(float(loss))
            result.grad_norms.append(norm)
            seen_tokens += int(count_tokens(tgt_out))
            done += 1
    result.tokens_per_step = seen_tokens / max(done, 1)
    result.val_nll, result.bleu = evaluate(net, data, eval_batches)
    result.seconds = time.perf_counter() - start
    return result


def spikes(norms: list[float], factor: float = 5.0, window: int = 10) -> int:
    """Steps whose gradient norm exceeds ``factor`` x the median of the previous ``window`` steps."""
    count = 0
    for i in range(window, len(norms)):
        previous = sorted(norms[i - window:i])
        median = previous[window // 2]
        if not math.isfinite(norms[i]) or norms[i] > factor * median:
            count += 1
    return count

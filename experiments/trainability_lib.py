"""Trainability runs on a short synthetic translation task: one run, its facts, and the rules both scripts state.

One run trains the encoder-decoder ``transformer_tiny`` (post- or pre-norm, with or
without the paper's two fixes) on the built-in synthetic language pair with short
sentences, in plain PyTorch (no pipeline: K=1, one process, one thread; the engine is not
what is tested here), Adam (betas 0.9/0.98) with linear warm-up, and reports:

- ``start``: the loss of step 0 (before any update); ``final``: the mean loss of the last 10 steps;
- ``diverged``: a non-finite loss or gradient at any step (the run stops there), or ``final > start``
  (not recovered by the end);
- ``spike``: the largest rise of the loss after step 0 above the lowest loss before it, as a share
  of the starting loss (a transient spike when above ``SPIKE``), reported apart from ``diverged``; a
  rise, not a ratio, so that batch noise near a loss of zero is no spike;
- ``bleu`` (sacrebleu, 0-100) and ``exact`` (share of sentences decoded exactly) of greedy
  decoding on the validation pairs; ``learns``: not diverged and ``bleu >= BAR``;
- ``clip_steps``: steps whose raw output logits (before any clip) exceed the clip threshold
  somewhere, and ``clip_share``: the share of all training logits above it. With a logit clip
  these count the clip binding; without one, how often it would have bound.

``verdict`` turns a report's runs into "reproduced" / "not reproduced" by the rule ``RULE``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import Any

#: Validation BLEU (sacrebleu, 0-100) a run must reach to "learn"; stated before any run.
BAR = 80.0
#: A loss this share of the starting loss above the lowest loss before it is a transient spike.
SPIKE = 0.25
#: Share of the deepest baseline's runs that must fail (diverge or miss the bar), and share of its runs with
#: both fixes that must learn, for "reproduced".
FAIL_SHARE, LEARN_SHARE = 0.6, 0.8
VARIANTS = ("none", "ffn init scaling", "logit clip", "both")
RULES = (f"learns = validation BLEU (sacrebleu, greedy decoding) >= {BAR:g} and not diverged; "
         "diverged = a non-finite loss or gradient at any step (the run stops there) or a final loss "
         "(mean of the last 10 steps) above the starting loss (step 0, before any update); transient spike = "
         f"a loss after step 0 more than {SPIKE:g} x the starting loss above the lowest loss before it, counted "
         "apart from divergence")
RULE = ("reproduced = (a) every run of the shallow post-norm baselines (the two shallowest depths) learns, "
        f"(b) at the deepest depth the post-norm baseline fails (diverges or misses the bar) in at least "
        f"{FAIL_SHARE:.0%} of its seeds and (c) with both fixes at least {LEARN_SHARE:.0%} of its seeds learn; "
        "otherwise not reproduced (with (a) failing the experiment cannot show the claim)")


@dataclass(frozen=True)
class Task:
    """The model width and the data: short sentences of the built-in synthetic language pair."""

    d_model: int = 32
    ffn_dim: int = 64
    num_heads: int = 2
    batch_size: int = 64
    num_train: int = 4000
    num_val: int = 64
    min_len: int = 3
    max_len: int = 6


@dataclass(frozen=True)
class Setting:
    """What the selection chooses: Adam's learning rate, linear warm-up steps, optimizer steps."""

    lr: float
    warmup: int
    steps: int


@dataclass(frozen=True)
class Run:
    """One training run: depth (layers per side), norm placement, variant, seed."""

    layers: int
    pre_norm: bool
    variant: str
    seed: int
    setting: Setting
    task: Task = field(default_factory=Task)
    clip: float = 10.0

    def model_options(self) -> dict[str, object]:
        """``models.build`` overrides of this run.

        Raises:
            ValueError: an unknown variant.
        """
        if self.variant not in VARIANTS:
            raise ValueError(f"variant {self.variant!r} is not one of {VARIANTS}")
        return {"num_layers": self.layers, "d_model": self.task.d_model, "ffn_dim": self.task.ffn_dim,
                "num_heads": self.task.num_heads, "pre_norm": self.pre_norm,
                "ffn_init_scaling": self.variant in ("ffn init scaling", "both"),
                "logit_clip": self.clip if self.variant in ("logit clip", "both") else None}


def diverged(start: float, final: float, nonfinite: bool) -> bool:
    """The divergence rule: a non-finite step, or a final loss above the starting loss."""
    return nonfinite or not math.isfinite(final) or final > start


def largest_spike(losses: Sequence[float]) -> float:
    """The largest rise of a finite loss after step 0 above the lowest loss before it, over the starting loss
    (0.0 for fewer than two losses)."""
    lowest, worst = math.inf, 0.0
    for i, value in enumerate(losses):
        if i and math.isfinite(value):
            worst = max(worst, (value - lowest) / losses[0])
        lowest = min(lowest, value)
    return worst


def facts(losses: Sequence[float], nonfinite: bool, bleu: float) -> dict[str, Any]:
    """start, final, spike, diverged and learns of a run's losses (JSON-ready)."""
    start = losses[0] if losses else math.nan
    final = statistics.fmean(losses[-10:]) if losses else math.nan
    div = diverged(start, final, nonfinite)
    spike = largest_spike(losses)
    return {"start": start, "final": final, "final_over_start": final / start if start else math.nan,
            "spike": spike, "transient_spike": spike > SPIKE, "nonfinite": nonfinite, "diverged": div,
            "bleu": bleu, "learns": (not div) and bleu >= BAR}


def train(run: Run) -> dict[str, Any]:
    """Train one run; its facts, with the per-step losses and the clip counts.

    Raises:
        ValueError: an unknown variant or invalid sizes (from ``models.build``).
    """
    import torch

    from gpipe_lab.data import SyntheticTranslationDataModule, corpus_bleu
    from gpipe_lab.models import build, greedy_decode, token_cross_entropy

    torch.set_num_threads(1)
    t, s = run.task, run.setting
    data = SyntheticTranslationDataModule(tokens_per_batch=None, batch_size=t.batch_size, seed=run.seed,
                                          num_train=t.num_train, num_val=t.num_val, num_test=0,
                                          min_len=t.min_len, max_len=t.max_len)
    torch.manual_seed(run.seed)
    net = build("transformer_tiny", "cpu", vocab_size=data.vocab_size, **run.model_options())
    optimizer = torch.optim.Adam(net.parameters(), lr=s.lr, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / s.warmup) if s.warmup
                                                 else 1.0)
    above = [0, 0]  # logits above the threshold this step, all logits this step

    def count(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        above[0] += int((output.detach().abs() > run.clip).sum())
        above[1] += output.numel()

    net[-1].proj.register_forward_hook(count)  # the raw logits, before the clip
    losses: list[float] = []
    clip_steps, clipped, logits, nonfinite = 0, 0, 0, False
    began = time.perf_counter()
    while len(losses) < s.steps and not nonfinite:
        for (src, tgt_in), tgt_out in data.train_dataloader():
            above[:] = [0, 0]
            loss = token_cross_entropy(net((src, tgt_in)), tgt_out)
            optimizer.zero_grad()
            loss.backward()
            grads = [p.grad for p in net.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            losses.append(float(loss.detach()))
            clip_steps, clipped, logits = clip_steps + (above[0] > 0), clipped + above[0], logits + above[1]
            if not (math.isfinite(losses[-1]) and math.isfinite(float(norm))):
                nonfinite = True
                break
            optimizer.step()
            schedule.step()
            if len(losses) == s.steps:
                break
    bleu, exact = (0.0, 0.0) if nonfinite else evaluate(net, data, greedy_decode, corpus_bleu)
    return {**asdict(run), **facts(losses, nonfinite, bleu), "exact": exact, "steps_run": len(losses),
            "clip_steps": clip_steps, "clip_share": clipped / max(logits, 1),
            "params": sum(p.numel() for p in net.parameters()), "seconds": time.perf_counter() - began,
            "losses": losses}


def evaluate(net: Any, data: Any, decode: Callable, bleu: Callable) -> tuple[float, float]:
    """(BLEU, exact-match share) of greedy decoding on every validation pair."""
    import torch

    net.eval()
    hyps, refs = [], []
    references = data.batch_references("val")
    with torch.no_grad():
        for i, ((src, _), tgt_out) in enumerate(data.val_dataloader()):
            out = decode(lambda a, b: net((a, b)), src, max_len=tgt_out.shape[1] + 2)
            hyps += [data.decode(row.tolist()) for row in out]
            refs += references[i]
    net.train()
    return float(bleu(hyps, refs).score), sum(h == r for h, r in zip(hyps, refs)) / max(len(refs), 1)


def train_all(runs: Sequence[Run], workers: int, done: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """Every run's facts, in ``runs``' order; ``workers`` > 1: that many processes of one thread each,
    the deepest runs started first."""
    if workers <= 1:
        out = []
        for r in runs:
            out.append(train(r))
            done(out[-1])
        return out
    order = sorted(range(len(runs)), key=lambda i: -runs[i].layers)
    results: dict[int, dict] = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = {i: pool.submit(train, runs[i]) for i in order}
        for i in order:
            results[i] = futures[i].result()
            done(results[i])
    return [results[i] for i in range(len(runs))]


def mean_range(values: Sequence[float], digits: int = 1) -> str:
    """``mean [min, max]`` of the finite values (``-`` for none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "-"
    return f"{statistics.fmean(finite):.{digits}f} [{min(finite):.{digits}f}, {max(finite):.{digits}f}]"


def count(runs: Sequence[dict], key: str) -> str:
    """``n / seeds`` of the runs where ``key`` holds."""
    return f"{sum(bool(r[key]) for r in runs)} / {len(runs)}"


def verdict(shallow: Sequence[dict], deep_none: Sequence[dict], deep_both: Sequence[dict]) -> tuple[str, str]:
    """("reproduced" | "not reproduced", the reason in numbers) by ``RULE``.

    ``shallow``: every run of the shallow post-norm baselines; ``deep_none`` / ``deep_both``: the deepest
    post-norm runs without fixes and with both.

    Raises:
        ValueError: an empty group.
    """
    if not (shallow and deep_none and deep_both):
        raise ValueError("verdict needs shallow, deepest-baseline and deepest-both runs; one group is empty")
    a = all(r["learns"] for r in shallow)
    fails = sum(not r["learns"] for r in deep_none)
    learns = sum(r["learns"] for r in deep_both)
    b, c = fails >= FAIL_SHARE * len(deep_none), learns >= LEARN_SHARE * len(deep_both)
    reason = (f"(a) shallow baselines learn in {sum(r['learns'] for r in shallow)} of {len(shallow)} "
              f"({'met' if a else 'missed'}); (b) the deepest baseline fails in {fails} of {len(deep_none)} "
              f"({'met' if b else 'missed'}); (c) with both fixes {learns} of {len(deep_both)} learn "
              f"({'met' if c else 'missed'})")
    return ("reproduced" if a and b and c else "not reproduced"), reason

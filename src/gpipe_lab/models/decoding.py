"""Greedy and beam-search decoding against ``forward_fn(src, tgt_in) -> logits [B,T,V]``.

``forward_fn`` may be the plain model (``lambda s, t: model((s, t))``) or a
pipeline's forward (``lambda s, t: pipe((s, t))``): decoding re-runs the full
decoder on the growing prefix each step (no cache), so only that call is needed.
Outputs exclude BOS, include the EOS that ended a sequence, and are PAD after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gpipe_lab.models.transformer_layers import BOS, EOS, PAD

__all__ = ["greedy_decode", "beam_search"]

ForwardFn = Callable[[Tensor, Tensor], Tensor]


@torch.no_grad()
def greedy_decode(forward_fn: ForwardFn, src: Tensor, max_len: int, bos: int = BOS, eos: int = EOS,
                  pad: int = PAD) -> Tensor:
    """Arg-max decoding of up to ``max_len`` tokens for each row of ``src [B,S]``; returns ``[B, <=max_len]``.

    Raises ``ValueError`` if ``max_len`` is not positive.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    seqs = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        token = forward_fn(src, seqs)[:, -1].argmax(-1)
        token = torch.where(done, torch.full_like(token, pad), token)
        seqs = torch.cat([seqs, token[:, None]], dim=1)
        done |= token == eos
        if bool(done.all()):
            break
    return seqs[:, 1:]


@torch.no_grad()
def beam_search(forward_fn: ForwardFn, src: Tensor, max_len: int, beam_size: int = 4,
                length_penalty: float = 0.0, bos: int = BOS, eos: int = EOS, pad: int = PAD) -> Tensor:
    """Beam search; returns the best hypothesis per row, ``[B, <=max_len]``.

    Hypotheses are ranked by summed log-probability divided by the GNMT length
    penalty ``((5 + length) / 6) ** length_penalty`` (0 = no penalty). A finished
    beam only extends with PAD at no cost. ``beam_size=1`` equals ``greedy_decode``.
    Raises ``ValueError`` if ``max_len`` or ``beam_size`` is not positive.
    """
    if max_len <= 0 or beam_size <= 0:
        raise ValueError(f"max_len and beam_size must be positive, got {max_len} and {beam_size}")
    B, k, dev = src.shape[0], beam_size, src.device
    src_rep = src.repeat_interleave(k, dim=0)
    seqs = torch.full((B * k, 1), bos, dtype=torch.long, device=dev)
    scores = torch.zeros(B, k, device=dev)
    scores[:, 1:] = float("-inf")  # all beams start identical: keep one
    finished = torch.zeros(B * k, dtype=torch.bool, device=dev)
    for _ in range(max_len):
        logp = forward_fn(src_rep, seqs)[:, -1].float().log_softmax(-1)
        V = logp.shape[-1]
        logp[finished] = float("-inf")
        logp[finished, pad] = 0.0
        cand = (scores.reshape(B * k, 1) + logp).reshape(B, k * V)
        scores, flat = cand.topk(k, dim=-1)
        origin = (torch.arange(B, device=dev)[:, None] * k + flat // V).reshape(-1)
        token = (flat % V).reshape(-1)
        seqs = torch.cat([seqs[origin], token[:, None]], dim=1)
        finished = finished[origin] | (token == eos)
        if bool(finished.all()):
            break
    lengths = (seqs[:, 1:] != pad).sum(-1).reshape(B, k).float()
    ranked = scores / ((5.0 + lengths) / 6.0) ** length_penalty
    best = seqs[ranked.argmax(-1) + torch.arange(B, device=dev) * k, 1:]
    width = int((best != pad).sum(-1).max())  # drop all-PAD columns left by other beams
    return best[:, :width]

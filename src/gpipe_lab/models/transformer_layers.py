"""Transformer building blocks, each one element of the flat layer sequence.

Boundary formats (every value a tensor, so a pipeline can cut anywhere):
- encoder-decoder: the embedding takes ``(src [B,S] long, tgt_in [B,T] long)`` and
  returns ``(enc [B,S,d], dec [B,T,d], src_mask [B,1,1,S])``; ``src_mask`` is an
  additive float mask (0 for tokens, the dtype's minimum for PAD). Encoder layers
  update ``enc``, decoder layers update ``dec`` reading ``enc``; the head returns
  logits ``[B,T,V]``.
- decoder-only: the embedding takes ``tokens [B,T] long`` and returns ``h [B,T,d]``;
  causal layers map ``h -> h``; the head returns logits ``[B,T,V]``.
Dropout happens only in ``nn.Dropout`` modules (the engine may swap them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "PAD", "BOS", "EOS", "UNK", "MultiHeadAttention", "FeedForward", "Block", "Embedding",
    "EncoderLayer", "DecoderLayer", "EncoderFinalNorm", "CausalLayer", "TokenEmbedding", "OutputHead",
]

PAD, BOS, EOS, UNK = 0, 1, 2, 3


def sinusoidal_positions(length: int, d_model: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[length, d_model]`` sine/cosine position encodings (no parameters)."""
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * (-math.log(1e4) / d_model))
    pe = torch.zeros(length, d_model, device=device, dtype=torch.float32)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)[:, : d_model // 2]
    return pe.to(dtype)


class MultiHeadAttention(nn.Module):
    """Multi-head attention; probability dropout through an ``nn.Dropout`` module."""

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.num_heads, self.p = num_heads, dropout
        self.q, self.k, self.v, self.out = (nn.Linear(d_model, d_model) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        B, T, d = x.shape
        h = self.num_heads

        def split(t: Tensor) -> Tensor:
            return t.view(B, t.shape[1], h, d // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(memory)), split(self.v(memory))
        if self.p == 0.0:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)
            if mask is not None:
                scores = scores + mask
            if causal:
                S = k.shape[2]
                future = torch.ones(T, S, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
            y = self.dropout(scores.softmax(-1)) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class FeedForward(nn.Module):
    """Linear(d, H), ReLU, dropout, Linear(H, d): the two weights Fixup scales."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, ffn_dim), nn.Linear(ffn_dim, d_model)
        self.relu, self.dropout = nn.ReLU(), nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(self.relu(self.w1(x))))


class Block(nn.Module):
    """Self-attention [, cross-attention], FFN; each a residual sub-layer, pre- or post-norm."""

    def __init__(self, d_model: int, ffn_dim: int, num_heads: int, cross_attention: bool, pre_norm: bool,
                 dropout: float, attention_dropout: float, relu_dropout: float) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.self_attn = MultiHeadAttention(d_model, num_heads, attention_dropout)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, attention_dropout) if cross_attention else None
        self.ffn = FeedForward(d_model, ffn_dim, relu_dropout)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(3 if cross_attention else 2))
        self.dropout = nn.Dropout(dropout)

    def _residual(self, x: Tensor, i: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(fn(self.norms[i](x)))
        return self.norms[i](x + self.dropout(fn(x)))

    def sublayers(self, x: Tensor, memory: Tensor | None = None, mask: Tensor | None = None,
                  causal: bool = False) -> Tensor:
        """The block on ``x``: a plain ``Block``'s forward; each layer below runs it on its part of the state."""
        x = self._residual(x, 0, lambda y: self.self_attn(y, y, None if causal else mask, causal))
        cross = self.cross_attn
        if cross is not None:
            x = self._residual(x, 1, lambda y: cross(y, memory, mask))
        return self._residual(x, len(self.norms) - 1, self.ffn)

    # typed as nn.Module's: each layer below has a forward of its own signature
    forward: Callable[..., Any] = sublayers


class Embedding(nn.Module):
    """``(src, tgt_in) -> (enc, dec, src_mask)``: scaled embeddings + sinusoidal positions."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float, share: bool) -> None:
        super().__init__()
        self.d_model = d_model
        self.src = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.tgt = self.src if share else nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        for emb in {id(self.src): self.src, id(self.tgt): self.tgt}.values():
            nn.init.normal_(emb.weight, std=d_model**-0.5)
            with torch.no_grad():
                emb.weight[PAD].zero_()
        self.dropout = nn.Dropout(dropout)

    def _embed(self, table: nn.Embedding, tokens: Tensor) -> Tensor:
        x = table(tokens) * math.sqrt(self.d_model)
        return self.dropout(x + sinusoidal_positions(tokens.shape[1], self.d_model, x.device, x.dtype))

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        src, tgt_in = batch
        enc, dec = self._embed(self.src, src), self._embed(self.tgt, tgt_in)
        mask = torch.zeros(src.shape, dtype=enc.dtype, device=enc.device)
        mask = mask.masked_fill(src == PAD, torch.finfo(enc.dtype).min)
        return enc, dec, mask[:, None, None, :]


class EncoderLayer(Block):
    def __init__(self, d_model: int, ffn_dim: int, num_heads: int, pre_norm: bool, dropout: float,
                 attention_dropout: float, relu_dropout: float) -> None:
        super().__init__(d_model, ffn_dim, num_heads, False, pre_norm, dropout, attention_dropout, relu_dropout)

    def forward(self, state: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        enc, dec, mask = state
        return self.sublayers(enc, mask=mask), dec, mask


class DecoderLayer(Block):
    def __init__(self, d_model: int, ffn_dim: int, num_heads: int, pre_norm: bool, dropout: float,
                 attention_dropout: float, relu_dropout: float) -> None:
        super().__init__(d_model, ffn_dim, num_heads, True, pre_norm, dropout, attention_dropout, relu_dropout)

    def forward(self, state: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        enc, dec, mask = state
        return enc, self.sublayers(dec, enc, mask, causal=True), mask


class EncoderFinalNorm(nn.Module):
    """Pre-norm only: LayerNorm of the encoder output before the decoder reads it."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)

    def forward(self, state: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        enc, dec, mask = state
        return self.norm(enc), dec, mask


class TokenEmbedding(nn.Module):
    """Decoder-only: ``tokens [B,T] -> h [B,T,d]``."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.inner = Embedding(vocab_size, d_model, dropout, share=True)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.inner._embed(self.inner.tgt, tokens)


class CausalLayer(Block):
    def __init__(self, d_model: int, ffn_dim: int, num_heads: int, pre_norm: bool, dropout: float,
                 attention_dropout: float, relu_dropout: float) -> None:
        super().__init__(d_model, ffn_dim, num_heads, False, pre_norm, dropout, attention_dropout, relu_dropout)

    def forward(self, h: Tensor) -> Tensor:
        return self.sublayers(h, causal=True)


class OutputHead(nn.Module):
    """[final LayerNorm], bias-free projection to the vocabulary, logit clipping in training.

    Takes the decoder state (or the encoder-decoder tuple) and returns ``[B,T,V]``.
    ``logit_clip`` clamps logits to ``[-logit_clip, logit_clip]`` in training mode
    only (Lingvo's ``SoftmaxLayer.logits_abs_max``); evaluation is unclipped.
    """

    def __init__(self, d_model: int, vocab_size: int, pre_norm: bool, logit_clip: float | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model) if pre_norm else nn.Identity()
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        self.logit_clip = logit_clip

    def forward(self, state: Tensor | tuple[Tensor, Tensor, Tensor]) -> Tensor:
        dec = state[1] if isinstance(state, tuple) else state
        logits = self.proj(self.norm(dec))
        if self.training and self.logit_clip is not None:
            logits = logits.clamp(-self.logit_clip, self.logit_clip)
        return logits

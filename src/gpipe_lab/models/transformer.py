"""Encoder-decoder Transformer T(L, H, A) and a decoder-only variant, as flat layer lists.

``build_transformer(TransformerConfig(...))`` returns an ``nn.Sequential``:
``[embedding, encoder_1..L, (encoder_norm if pre_norm), decoder_1..L, head]`` for
the encoder-decoder layout (batch ``(src [B,S], tgt_in [B,T])`` of token ids,
PAD=0 BOS=1 EOS=2 UNK=3), or ``[embedding, layer_1..L, head]`` for the
decoder-only layout (batch ``tokens [B,T]``). Both return logits ``[B,T,V]``.
See ``transformer_layers`` for the boundary tuples.

Trainability fixes (paper §5, both off by default):
- ``ffn_init_scaling``: multiply the two FFN weight matrices of every layer by
  ``L ** (-1 / (2 * m))`` with ``m = 2`` (Fixup, Zhang et al. 2019: a residual
  branch of m layers is scaled by depth^(-1/(2m-2)) in Fixup proper; Lingvo's
  GPipe Transformer uses ``depth ** (-1 / (2 * layers_per_residual_block))``,
  which we follow), i.e. ``L ** -0.25``, where L is the number of layers of the
  stack the FFN lives in (encoder and decoder each have L). Only the FFN weight
  matrices change; their biases, attention, norms and embeddings are untouched.
- ``logit_clip``: clamp output logits to ``[-t, t]`` in training mode only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_lab.models.transformer_layers import (
    Block,
    CausalLayer,
    DecoderLayer,
    Embedding,
    EncoderFinalNorm,
    EncoderLayer,
    OutputHead,
    TokenEmbedding,
)

__all__ = ["TransformerConfig", "build_transformer", "ffn_init_scale"]

LAYOUTS = ("encoder_decoder", "decoder_only")


@dataclass
class TransformerConfig:
    """Sizes and options; ``num_layers`` is per stack (L encoder + L decoder layers)."""

    num_layers: int = 6
    d_model: int = 1024
    ffn_dim: int = 8192
    num_heads: int = 16
    vocab_size: int = 64000
    layout: str = "encoder_decoder"
    share_embeddings: bool = False
    pre_norm: bool = True
    dropout: float = 0.1
    attention_dropout: float = 0.0
    relu_dropout: float = 0.0
    label_smoothing: float = 0.1
    ffn_init_scaling: bool = False
    logit_clip: float | None = None

    def validate(self) -> None:
        """Raises ``ValueError`` naming the offending key."""
        for key in ("num_layers", "d_model", "ffn_dim", "num_heads", "vocab_size"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.d_model % 2:
            raise ValueError(f"d_model must be even (sinusoidal positions), got {self.d_model}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for key in ("dropout", "attention_dropout", "relu_dropout", "label_smoothing"):
            if not 0.0 <= float(getattr(self, key)) < 1.0:
                raise ValueError(f"{key} must be in [0, 1), got {getattr(self, key)}")
        if self.logit_clip is not None and self.logit_clip <= 0:
            raise ValueError(f"logit_clip must be positive or None, got {self.logit_clip}")


def ffn_init_scale(num_layers: int, layers_per_branch: int = 2) -> float:
    """Fixup-style FFN init factor ``num_layers ** (-1 / (2 * layers_per_branch))``."""
    return float(num_layers) ** (-1.0 / (2 * layers_per_branch))


def build_transformer(config: TransformerConfig) -> nn.Sequential:
    """The flat layer sequence for ``config`` (built on the current default device).

    Raises ``ValueError`` for an invalid config (see ``TransformerConfig.validate``).
    """
    config.validate()
    c = config
    block_kwargs: dict[str, Any] = dict(pre_norm=c.pre_norm, dropout=c.dropout, attention_dropout=c.attention_dropout,
                        relu_dropout=c.relu_dropout)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    if c.layout == "encoder_decoder":
        embedding = Embedding(c.vocab_size, c.d_model, c.dropout, c.share_embeddings)
        layers["embedding"] = embedding
        for i in range(c.num_layers):
            layers[f"encoder{i + 1}"] = EncoderLayer(c.d_model, c.ffn_dim, c.num_heads, **block_kwargs)
        if c.pre_norm:
            layers["encoder_norm"] = EncoderFinalNorm(c.d_model)
        for i in range(c.num_layers):
            layers[f"decoder{i + 1}"] = DecoderLayer(c.d_model, c.ffn_dim, c.num_heads, **block_kwargs)
        tied = embedding.tgt.weight
    else:
        token_embedding = TokenEmbedding(c.vocab_size, c.d_model, c.dropout)
        layers["embedding"] = token_embedding
        for i in range(c.num_layers):
            layers[f"layer{i + 1}"] = CausalLayer(c.d_model, c.ffn_dim, c.num_heads, **block_kwargs)
        tied = token_embedding.inner.tgt.weight
    head = OutputHead(c.d_model, c.vocab_size, c.pre_norm, c.logit_clip)
    if c.share_embeddings:
        head.proj.weight = tied
    layers["head"] = head
    model = nn.Sequential(layers)
    if c.ffn_init_scaling:
        scale = ffn_init_scale(c.num_layers)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, Block):  # the layers with a feed-forward sub-layer
                    module.ffn.w1.weight.mul_(scale)
                    module.ffn.w2.weight.mul_(scale)
    return model

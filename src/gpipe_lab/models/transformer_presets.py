"""The paper's Transformer sizes, their parameter counts, and why they differ from the paper.

Encoder-decoder T(L, H, A) (d_model 1024, vocabulary 64k = 64,000 here):
``transformer_big`` T(6,8192,16) "400M", ``transformer_deep`` T(24,8192,16) "1.3B",
``transformer_wide`` T(12,16384,32) "1.3B", ``transformer_3b`` T(32,16384,32) "3B",
``transformer_6b`` T(64,16384,32) "6B". Our default keeps three separate vocabulary
tables (source embedding, target embedding, softmax: 3*64000*1024 = 196.6M) so a
pipeline can put the first and the last in different stages; the paper's counts
sit between that and fully shared embeddings (one 65.5M table). T(6,8192,16)
with separate tables is 473.7M, with a shared table 342.6M; the paper's 400M is
closest to tying the target embedding with the softmax (408.1M). T(24,8192,16)
is 1.30B as the paper says. T(12,16384,32), T(32,16384,32) and T(64,16384,32) come
out at 1.15B, 2.75B and 5.30B (separate tables), 12%, 8% and 12% under the
paper's labels; vocabulary layout cannot close that gap (all three tables
together are only 0.2B), so we read those labels as nominal names, not counts
(the paper gives no exact figures for them). ``describe_presets()`` prints all
variants.

Table 1's Transformer-L (d_model 2048, FFN 8192, 32 heads, vocabulary 32k) counts
"layers" of 50,358,272 parameters each: self-attention (4d^2 + 4d) + FFN
(2dH + H + d) + two LayerNorms (4d), i.e. encoder-style layers with no
cross-attention, plus one input embedding and one separate softmax of
32,000 x 2048 each (131.1M) and a final LayerNorm. We build it as a decoder-only
(causal) stack: 3, 13, 103, 415, 1663 layers give 282,150,912 (282.2M),
785,733,632 (785.7M), 5.32B, 21.03B and 83.88B parameters against Table 1's
282.2M, 785.8M, 5.3B, 21.0B and 83.9B (the 13-layer figure is 0.01% off, a
rounding-level difference). A 32,768-word vocabulary would give 285.3M for 3
layers, so the vocabulary is 32,000.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpipe_lab.models.transformer import TransformerConfig

__all__ = ["TRANSFORMER_PRESETS", "TRANSFORMER_L_PAPER", "transformer_param_count", "describe_presets"]

_NMT: dict[str, Any] = dict(d_model=1024, vocab_size=64000)
TRANSFORMER_PRESETS: dict[str, tuple[TransformerConfig, str]] = {
    "transformer_big": (TransformerConfig(num_layers=6, ffn_dim=8192, num_heads=16, **_NMT), "400M"),
    "transformer_deep": (TransformerConfig(num_layers=24, ffn_dim=8192, num_heads=16, **_NMT), "1.3B"),
    "transformer_wide": (TransformerConfig(num_layers=12, ffn_dim=16384, num_heads=32, **_NMT), "1.3B"),
    "transformer_3b": (TransformerConfig(num_layers=32, ffn_dim=16384, num_heads=32, **_NMT), "3B"),
    "transformer_6b": (TransformerConfig(num_layers=64, ffn_dim=16384, num_heads=32, **_NMT), "6B"),
    "transformer_l": (TransformerConfig(num_layers=3, d_model=2048, ffn_dim=8192, num_heads=32,
                                        vocab_size=32000, layout="decoder_only"), "282.2M (3 layers)"),
    # CPU-sized: the depth ratio of T(6, 8192, 16) (FFN = 8 d, 64-dim heads scaled to 16) at d = 64.
    "transformer_tiny": (TransformerConfig(num_layers=2, d_model=64, ffn_dim=256, num_heads=4,
                                           vocab_size=64, dropout=0.0, label_smoothing=0.0), "-"),
}

#: Table 1 (16 GB TPUv3): Transformer-L layers -> the paper's parameter count.
TRANSFORMER_L_PAPER = {3: "282.2M", 13: "785.8M", 103: "5.3B", 415: "21.0B", 1663: "83.9B"}


def transformer_param_count(config: TransformerConfig) -> int:
    """Closed-form parameter count of ``build_transformer(config)`` (tied tables counted once)."""
    d, H, V, L = config.d_model, config.ffn_dim, config.vocab_size, config.num_layers
    attn, ffn, norm = 4 * d * d + 4 * d, 2 * d * H + H + d, 2 * d
    self_layer = attn + ffn + 2 * norm
    final_norms = 2 * norm if config.pre_norm else 0
    if config.layout == "decoder_only":
        tables = 1 if config.share_embeddings else 2
        return L * self_layer + tables * V * d + final_norms // 2
    tables = 1 if config.share_embeddings else 3
    return L * (self_layer + (2 * attn + ffn + 3 * norm)) + tables * V * d + final_norms


def _fmt(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe_presets() -> str:
    """A table of every preset's parameter count (ours, computed) beside the paper's."""
    lines = [f"{'preset':<18} {'separate':>10} {'tied tgt':>10} {'shared':>10}  paper"]
    for name, (config, paper) in TRANSFORMER_PRESETS.items():
        if config.layout != "encoder_decoder":
            continue
        sep = transformer_param_count(config)
        shared = transformer_param_count(replace(config, share_embeddings=True))
        tied = sep - config.vocab_size * config.d_model
        lines.append(f"{name:<18} {_fmt(sep):>10} {_fmt(tied):>10} {_fmt(shared):>10}  {paper}")
    base = TRANSFORMER_PRESETS["transformer_l"][0]
    for layers, paper in TRANSFORMER_L_PAPER.items():
        n = transformer_param_count(replace(base, num_layers=layers))
        lines.append(f"{'transformer_l-' + str(layers):<18} {_fmt(n):>10} {'':>10} {'':>10}  {paper}")
    lines.append("separate: src emb + tgt emb + softmax (default, pipeline-cuttable); tied tgt: tgt emb = "
                 "softmax; shared: one table. transformer_l: decoder-only, separate input table and softmax.")
    return "\n".join(lines)

"""``build(name, device, **overrides)``: every preset model as a flat ``nn.Sequential``.

The returned module carries ``model.spec`` (a ``ModelSpec``: preset name, family
and the resolved options), which ``costs.example_input`` uses to make a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from gpipe_lab.models.amoebanet import build_amoebanet
from gpipe_lab.models.transformer import build_transformer
from gpipe_lab.models.transformer_presets import TRANSFORMER_PRESETS

__all__ = ["ModelSpec", "PRESETS", "build", "preset_names", "preset_options"]

AMOEBANET_PRESETS: dict[str, dict[str, Any]] = {
    "amoebanet_d": dict(genotype="d", num_layers=18, num_filters=208, num_classes=1000, image_size=224),
    # The paper trained AmoebaNet-B(18, 512) at 480x480.
    "amoebanet_b": dict(genotype="b", num_layers=18, num_filters=512, num_classes=1000, image_size=480),
    "amoebanet_d_tiny": dict(genotype="d", num_layers=3, num_filters=16, num_classes=10, image_size=32),
}
AMOEBANET_OVERRIDES = ("num_layers", "num_filters", "num_classes", "image_size", "stem_cell_filters")
TRANSFORMER_OVERRIDES = tuple(f.name for f in fields(TRANSFORMER_PRESETS["transformer_big"][0])) + (
    "seq_len",
)
#: Default sequence length of ``example_input`` (Table 1 used 1024 for Transformer-L).
DEFAULT_SEQ_LEN = {"transformer_l": 1024, "transformer_tiny": 16}

PRESETS = tuple(AMOEBANET_PRESETS) + tuple(TRANSFORMER_PRESETS)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "amoebanet" or "transformer"
    options: dict[str, Any] = field(default_factory=dict)


def preset_names() -> tuple[str, ...]:
    return PRESETS


def preset_options(name: str) -> dict[str, Any]:
    """Preset ``name``'s default options (what ``build(name).spec.options`` holds), without building it.

    Raises:
        ValueError: an unknown preset (naming the known ones).
    """
    if name in AMOEBANET_PRESETS:
        return dict(AMOEBANET_PRESETS[name])
    if name in TRANSFORMER_PRESETS:
        return {**vars(TRANSFORMER_PRESETS[name][0]), "seq_len": DEFAULT_SEQ_LEN.get(name, 256)}
    raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")


def _check_overrides(name: str, overrides: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(f"unknown override(s) {unknown} for preset {name!r}; allowed: {', '.join(allowed)}")


def build(name: str, device: str | torch.device = "cpu", **overrides: Any) -> nn.Sequential:
    """Build preset ``name`` on ``device`` (``"meta"`` allocates nothing) with ``overrides``.

    Presets: ``amoebanet_d``, ``amoebanet_b``, ``amoebanet_d_tiny``, ``transformer_big``,
    ``transformer_deep``, ``transformer_wide``, ``transformer_3b``, ``transformer_6b``,
    ``transformer_l`` (Table 1 family; ``num_layers`` picks the member), ``transformer_tiny``.
    AmoebaNet overrides: num_layers, num_filters, num_classes, image_size, stem_cell_filters.
    Transformer overrides: every ``TransformerConfig`` field (num_layers, d_model, ffn_dim,
    num_heads, vocab_size, layout, share_embeddings, pre_norm, dropout, attention_dropout,
    relu_dropout, label_smoothing, ffn_init_scaling, logit_clip) and seq_len (example input).

    Raises ``ValueError`` for an unknown preset or override (naming the allowed
    ones) and for a non-positive size (naming the key).
    """
    if name in AMOEBANET_PRESETS:
        _check_overrides(name, overrides, AMOEBANET_OVERRIDES)
        options = {**AMOEBANET_PRESETS[name], **overrides}
        if int(options["image_size"]) <= 0:
            raise ValueError(f"image_size must be positive, got {options['image_size']}")
        kwargs = {k: v for k, v in options.items() if k != "image_size"}
        with torch.device(device):
            model = build_amoebanet(**kwargs)
        # torch types Module.__setattr__ for tensors and modules; a plain attribute is allowed too
        model.spec = ModelSpec(name, "amoebanet", options)  # type: ignore[assignment]
        return model
    if name in TRANSFORMER_PRESETS:
        _check_overrides(name, overrides, TRANSFORMER_OVERRIDES)
        seq_len = int(overrides.pop("seq_len", DEFAULT_SEQ_LEN.get(name, 256)))
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        config = replace(TRANSFORMER_PRESETS[name][0], **overrides)
        with torch.device(device):
            model = build_transformer(config)
        model.spec = ModelSpec(name, "transformer", {**vars(config), "seq_len": seq_len})  # type: ignore[assignment]
        return model
    raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")

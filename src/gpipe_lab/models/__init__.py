"""The paper's models as flat layer sequences (AmoebaNet-D/B, Transformer T(L,H,A)).

``build(name, device, **overrides)`` returns an ``nn.Sequential`` a pipeline can
cut between any two elements; ``example_input`` gives a sample batch for it
(``gpipe_lab.planner.preset_costs`` measures a cost per element).
This package never imports the pipeline engine.
"""

__all__ = [
    "BOS", "EOS", "PAD", "PRESETS", "TRANSFORMER_L_PAPER", "TRANSFORMER_PRESETS", "UNK",
    "ModelSpec", "TransformerConfig", "amoebanet_d_params", "beam_search", "build", "build_amoebanet",
    "build_transformer", "count_tokens", "describe_presets", "example_input", "ffn_init_scale",
    "greedy_decode", "preset_names", "preset_options", "token_cross_entropy", "transformer_param_count",
    "translation_loss",
]

from gpipe_lab.models.amoebanet import amoebanet_d_params, build_amoebanet
from gpipe_lab.models.decoding import beam_search, greedy_decode
from gpipe_lab.models.losses import count_tokens, token_cross_entropy, translation_loss
from gpipe_lab.models.preset_registry import PRESETS, ModelSpec, build, preset_names, preset_options
from gpipe_lab.models.samples import example_input
from gpipe_lab.models.transformer import TransformerConfig, build_transformer, ffn_init_scale
from gpipe_lab.models.transformer_layers import BOS, EOS, PAD, UNK
from gpipe_lab.models.transformer_presets import (
    TRANSFORMER_L_PAPER,
    TRANSFORMER_PRESETS,
    describe_presets,
    transformer_param_count,
)

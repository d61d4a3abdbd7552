"""Transformer: preset counts, boundary formats, trainability fixes, loss, pipeline equivalence."""

import copy
from dataclasses import replace

import pytest
import torch

from gpipe_lab.models import (
    PAD,
    TRANSFORMER_L_PAPER,
    TRANSFORMER_PRESETS,
    build,
    count_tokens,
    describe_presets,
    ffn_init_scale,
    token_cross_entropy,
    transformer_param_count,
    translation_loss,
)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def batch(b=4, s=7, t=6, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (b, s), generator=g)
    tgt = torch.randint(4, vocab, (b, t + 1), generator=g)
    src[0, s - 2:] = PAD
    tgt[1, t - 1:] = PAD
    return src, tgt[:, :-1], tgt[:, 1:]


# Counts computed by the builder on the meta device (see transformer_presets.py for the gaps
# to the paper's nominal 400M / 1.3B / 1.3B / 3B / 6B).
PRESET_COUNTS = {
    "transformer_big": 473_681_920, "transformer_deep": 1_304_891_392, "transformer_wide": 1_153_601_536,
    "transformer_3b": 2_748_583_936, "transformer_6b": 5_300_555_776, "transformer_l": 282_150_912,
    "transformer_tiny": 246_016,
}


@pytest.mark.parametrize("name", sorted(PRESET_COUNTS))
def test_preset_parameter_counts(name):
    model = build(name, device="meta")
    assert n_params(model) == PRESET_COUNTS[name] == transformer_param_count(TRANSFORMER_PRESETS[name][0])


def test_shared_embeddings_count_once():
    model = build("transformer_big", device="meta", share_embeddings=True)
    assert n_params(model) == 342_609_920 == 473_681_920 - 2 * 64000 * 1024


def test_table1_transformer_l_family():
    base = TRANSFORMER_PRESETS["transformer_l"][0]
    counts = {layers: transformer_param_count(replace(base, num_layers=layers)) for layers in TRANSFORMER_L_PAPER}
    assert counts[3] == 282_150_912  # Table 1: 282.2M
    assert counts[13] == 785_733_632  # 785.8M
    assert round(counts[103] / 1e8) / 10 == 5.3
    assert round(counts[415] / 1e8) / 10 == 21.0
    assert round(counts[1663] / 1e8) / 10 == 83.9
    model = build("transformer_l", device="meta", num_layers=1663)
    assert all(p.is_meta for p in model.parameters())  # 84B parameters, none allocated
    assert n_params(model) == counts[1663] == 83_876_882_432
    assert "83.88B" in describe_presets()


def test_tiny_forward_backward_and_boundary_formats():
    torch.manual_seed(0)
    model = build("transformer_tiny")
    src, tgt_in, tgt_out = batch()
    value = (src, tgt_in)
    for layer in list(model)[:-1]:
        value = layer(value)
        assert isinstance(value, tuple) and len(value) == 3
        assert all(isinstance(t, torch.Tensor) for t in value)
        assert value[0].shape == (4, 7, 64) and value[1].shape == (4, 6, 64)
        assert value[2].shape == (4, 1, 1, 7)
    logits = model[-1](value)
    assert logits.shape == (4, 6, 64)
    token_cross_entropy(logits, tgt_out).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("pre_norm", [True, False])
def test_decoder_only_and_post_norm_forward(pre_norm):
    model = build("transformer_l", num_layers=2, d_model=32, ffn_dim=64, num_heads=4, vocab_size=50,
                  pre_norm=pre_norm)
    assert model(torch.randint(4, 50, (2, 5))).shape == (2, 5, 50)
    enc_dec = build("transformer_tiny", pre_norm=pre_norm, dropout=0.1, attention_dropout=0.1)
    src, tgt_in, _ = batch()
    assert enc_dec((src, tgt_in)).shape == (4, 6, 64)


def test_logit_clipping_training_only():
    torch.manual_seed(0)
    model = build("transformer_tiny", logit_clip=0.05)
    src, tgt_in, _ = batch()
    assert model((src, tgt_in)).abs().max() <= 0.05 + 1e-7
    model.eval()
    assert model((src, tgt_in)).abs().max() > 0.05


def test_ffn_init_scaling_changes_exactly_ffn_weights():
    torch.manual_seed(0)
    plain = build("transformer_tiny", num_layers=4)
    torch.manual_seed(0)
    scaled = build("transformer_tiny", num_layers=4, ffn_init_scaling=True)
    factor = ffn_init_scale(4)
    assert factor == pytest.approx(4 ** -0.25)  # depth^(-1/(2m)), m = 2 layers per FFN branch
    changed = 0
    for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
        if ".ffn.w1.weight" in name or ".ffn.w2.weight" in name:
            assert torch.allclose(q, p * factor)
            changed += 1
        else:
            assert torch.equal(p, q), name
    assert changed == 2 * 4 * 2


def test_loss_mean_sum_and_smoothing():
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(1, 11, (3, 5))
    targets[0, 3:] = PAD
    mask = targets != PAD
    manual = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
    assert torch.allclose(token_cross_entropy(logits, targets), manual)
    assert torch.allclose(token_cross_entropy(logits, targets, reduction="sum"), manual * mask.sum())
    assert count_tokens(targets) == mask.sum()
    smooth = translation_loss(0.1)(logits, targets)
    assert torch.allclose(smooth, torch.nn.functional.cross_entropy(logits[mask], targets[mask],
                                                                    label_smoothing=0.1))
    assert token_cross_entropy(logits, torch.zeros_like(targets)) == 0
    with pytest.raises(ValueError, match="reduction"):
        translation_loss(reduction="avg")


def test_pipelined_transformer_equals_unpipelined():
    pipeline = pytest.importorskip("gpipe_lab.pipeline")
    torch.manual_seed(0)
    model = build("transformer_tiny", dropout=0.0)
    reference = copy.deepcopy(model)
    src, tgt_in, tgt_out = batch(b=8)
    ref_loss = token_cross_entropy(reference((src, tgt_in)), tgt_out)
    ref_loss.backward()
    pipe = pipeline.GPipe(model, partitions=2, chunks=4, checkpoint="except_last")
    loss = pipe.train_step((src, tgt_in), tgt_out, translation_loss(reduction="sum"),
                           loss_normalizer=count_tokens)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name

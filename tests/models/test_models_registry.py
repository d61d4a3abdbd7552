"""build(): presets, overrides, errors, meta device; preset_costs; no engine import."""

import subprocess
import sys

import pytest
import torch

from gpipe_lab.models import PRESETS, build, preset_options
from gpipe_lab.pipeline.measuring.costs import COST_KINDS
from gpipe_lab.planner.preset_costs import preset_costs


def test_every_preset_builds_on_meta():
    for name in PRESETS:
        model = build(name, device="meta")
        assert isinstance(model, torch.nn.Sequential)
        assert all(p.is_meta for p in model.parameters())
        assert model.spec.name == name
        assert preset_options(name) == model.spec.options  # the defaults, read without building


def test_preset_options_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="unknown model preset 'amoebanet_x'; known presets: amoebanet_d"):
        preset_options("amoebanet_x")


def test_unknown_names_and_overrides():
    with pytest.raises(ValueError, match="amoebanet_d.*transformer_tiny"):
        build("resnet50")
    with pytest.raises(ValueError, match="d_model.*allowed: num_layers, num_filters"):
        build("amoebanet_d_tiny", d_model=3)
    with pytest.raises(ValueError, match="num_filters.*allowed.*ffn_dim"):
        build("transformer_tiny", num_filters=3)


@pytest.mark.parametrize("name,key", [("amoebanet_d_tiny", "num_layers"), ("amoebanet_d_tiny", "image_size"),
                                      ("amoebanet_d_tiny", "num_classes"), ("transformer_tiny", "d_model"),
                                      ("transformer_tiny", "ffn_dim"), ("transformer_tiny", "num_heads"),
                                      ("transformer_tiny", "vocab_size"), ("transformer_tiny", "num_layers")])
def test_non_positive_sizes_name_the_key(name, key):
    with pytest.raises(ValueError, match=key):
        build(name, device="meta", **{key: 0})


@pytest.mark.parametrize("name", ["amoebanet_d_tiny", "transformer_tiny"])
def test_layer_costs(name):
    model = build(name)
    params = preset_costs(model, "params")
    assert len(params) == len(model)
    assert sum(params) == sum(p.numel() for p in model.parameters())
    for kind in COST_KINDS[1:]:
        costs = preset_costs(model, kind)
        assert len(costs) == len(model) and all(c >= 0 for c in costs) and sum(costs) > 0
    assert all(p.device.type == "cpu" for p in model.parameters())  # measured on a meta replica


def test_flops_of_a_linear_layer_stack_are_exact():
    # transformer_tiny encoder layer at batch 1, S = 16, d = 64, H = 256, 4 heads:
    # q,k,v,o projections 4*2*S*d*d, attention scores and mix 2*2*S*S*d, FFN 2*2*S*d*H.
    model = build("transformer_tiny")
    s, d, h = 16, 64, 256
    expected = 4 * 2 * s * d * d + 2 * 2 * s * s * d + 2 * 2 * s * d * h
    assert preset_costs(model, "flops")[1] == expected


@pytest.mark.parametrize("name", ["amoebanet_d_tiny", "transformer_tiny"])
def test_flops_are_counted_as_in_training_mode_and_the_modes_are_left_as_they_were(name):
    """The count runs in eval mode (cheaper meta BatchNorm): the same FLOPs as a training-mode count."""
    from gpipe_lab.models import example_input
    from gpipe_lab.pipeline.measuring.costs import measure_layers

    model = build(name, device="meta")
    model.train()
    model[1].eval()  # a mixed state must come back as it was
    modes = [m.training for m in model.modules()]
    in_training = [c / 2 for c in measure_layers(model.train(), example_input(model, 2, "meta"), "flops")]
    for m, training in zip(model.modules(), modes):
        m.training = training
    assert preset_costs(model, "flops") == in_training and sum(in_training) > 0
    assert [m.training for m in model.modules()] == modes


def test_activation_bytes_scale_with_input():
    small = preset_costs(build("transformer_tiny", device="meta"), "activation_bytes")
    large = preset_costs(build("transformer_tiny", device="meta", seq_len=32), "activation_bytes")
    assert all(b >= a for a, b in zip(small, large)) and sum(large) > 1.9 * sum(small)


def test_big_preset_costs_on_meta():
    costs = preset_costs(build("transformer_l", device="meta", num_layers=4), "activation_bytes")
    assert len(costs) == 6 and costs[1] == costs[2] > 0


def test_costs_on_a_given_batch_leave_the_model_as_it_was():
    model = build("amoebanet_d_tiny", num_filters=8, image_size=8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    x = torch.randn(4, 3, 8, 8)
    for kind in COST_KINDS[1:]:
        costs = preset_costs(model, kind, example_input_=x, batch_size=4)
        assert len(costs) == len(model) and sum(costs) > 0
    assert model.training
    for k, v in model.state_dict().items():  # BatchNorm statistics included
        assert torch.equal(v, state[k]), k


def test_one_measuring_implementation():
    import gpipe_lab.pipeline.measuring.costs as measure
    import gpipe_lab.planner.preset_costs as model_costs
    from gpipe_lab.pipeline import layer_costs as engine_layer_costs

    assert engine_layer_costs is measure.layer_costs
    assert model_costs.measure_layers is measure.measure_layers
    model = build("transformer_tiny")
    sample = torch.randint(4, 64, (2, 16))
    assert preset_costs(model, "flops", example_input_=(sample, sample)) == \
        engine_layer_costs(model, "flops", (sample, sample))


def test_models_do_not_import_the_engine():
    code = ("import sys, types; m = types.ModuleType('gpipe_lab'); m.__path__ = [sys.argv[1]]; "
            "sys.modules['gpipe_lab'] = m; import gpipe_lab.models; "
            "assert not any(k.startswith('gpipe_lab.pipeline') for k in sys.modules)")
    import gpipe_lab

    subprocess.run([sys.executable, "-c", code, gpipe_lab.__path__[0]], check=True)


def test_preset_time_costs_run_the_real_model_and_refuse_the_meta_device() -> None:
    from gpipe_lab.models import build
    from gpipe_lab.planner.preset_costs import preset_costs

    model = build("transformer_tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    costs = preset_costs(model, "time", batch_size=4)
    assert len(costs) == len(model) and all(c > 0 for c in costs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="cost 'time' runs the model: build it with real weights"):
        preset_costs(build("transformer_tiny", device="meta"), "time")

"""The capacity planner: exact paper parameter counts, monotone memory, re-materialization."""

from __future__ import annotations

import json

import pytest

from gpipe_lab.models import amoebanet_d_params, build
from gpipe_lab.planner import capacity, memory
from gpipe_lab.planner.capacity import GiB, best_plan, plan_memory
from gpipe_lab.planner.cli import main
from gpipe_lab.planner.memory import layer_records

AMOEBA_CONFIGS = [(18, 208, 81_505_540), (18, 416, 319_024_120), (18, 544, None), (36, 544, None),
                  (72, 512, None)]
TRANSFORMER_L = {3: 282_150_912, 13: 785_733_632, 103: 5.32e9, 415: 21.03e9, 1663: 83.88e9}


@pytest.mark.parametrize("layers,filters,exact", AMOEBA_CONFIGS)
def test_amoebanet_paper_configs_have_the_exact_parameter_count(layers, filters, exact):
    params = sum(r.params for r in layer_records("amoebanet_d", num_layers=layers, num_filters=filters,
                                                 image_size=32))
    assert params == amoebanet_d_params(layers, filters)
    if exact is not None:
        assert params == exact


@pytest.mark.parametrize("layers,expected", TRANSFORMER_L.items())
def test_transformer_l_paper_configs_have_the_paper_parameter_count(layers, expected):
    params = sum(r.params for r in layer_records("transformer_l", num_layers=layers, seq_len=16))
    if isinstance(expected, int):
        assert params == expected
    else:
        assert params == pytest.approx(expected, rel=1e-3)


def test_replicated_records_equal_measuring_every_layer():
    full = memory._records_of(build("amoebanet_d", "meta", num_layers=15, num_filters=16, image_size=32))
    assert list(layer_records("amoebanet_d", num_layers=15, num_filters=16, image_size=32)) == full
    full_t = memory._records_of(build("transformer_l", "meta", num_layers=3, seq_len=16))
    assert list(layer_records("transformer_l", num_layers=3, seq_len=16)) == full_t


def test_last_layer_counts_the_loss_and_the_attention_probabilities():
    recs = layer_records("transformer_l", num_layers=1, seq_len=64)
    head, layer = recs[-1], recs[1]
    assert head.saved_other >= 64 * 32000 * 4  # log-softmax output of one sequence
    assert layer.saved_other >= 32 * 64 * 64 * 4  # attention probabilities (32 heads)


@pytest.mark.parametrize("name,sizes", [("transformer_l", dict(num_layers=16, seq_len=64)),
                                        ("amoebanet_d", dict(num_layers=18, num_filters=64, image_size=64))])
def test_peak_memory_per_partition_decreases_with_more_partitions(name, sizes):
    recs = layer_records(name, **sizes)
    peaks, params = [], []
    for k in (1, 2, 4, 8):
        plan = best_plan(recs, k, 8 * GiB, batch=32, microbatches=8)
        peaks.append(plan.peak_bytes)
        params.append(sum(p.parameter_bytes for p in plan.partitions))
    assert all(a >= b for a, b in zip(peaks, peaks[1:])), peaks
    assert peaks[0] > peaks[-1]
    assert params == [params[0]] * 4


@pytest.mark.parametrize("name,sizes", [("transformer_l", dict(num_layers=6, seq_len=64)),
                                        ("amoebanet_d", dict(num_layers=6, num_filters=32, image_size=64))])
def test_rematerialization_reduces_activation_memory(name, sizes):
    recs = layer_records(name, **sizes)
    for k in (1, 2):
        balance = best_plan(recs, k, GiB, 32, 8).balance
        kept = plan_memory(recs, balance, GiB, 32, 8, remat=False)
        remat = plan_memory(recs, balance, GiB, 32, 8, remat=True)
        assert sum(p.activation_bytes for p in remat.partitions) < 0.5 * sum(
            p.activation_bytes for p in kept.partitions)
    more_micro = best_plan(recs, 2, GiB, 32, 32)
    fewer_micro = best_plan(recs, 2, GiB, 32, 2)
    assert more_micro.peak_bytes < fewer_micro.peak_bytes


def test_bytes_per_param_and_capacity():
    recs = layer_records("transformer_l", num_layers=3, seq_len=16)
    plan = plan_memory(recs, [len(recs)], 16 * GiB, 1, 1, bytes_per_param=12)
    assert plan.partitions[0].parameter_bytes == 282_150_912 * 12
    assert plan.fits
    assert not plan_memory(recs, [len(recs)], GiB, 1, 1).fits


def test_search_finds_more_layers_with_more_partitions():
    one = capacity.max_transformer_layers(1, 16 * GiB, 32, 32, True, seq_len=128, upper=256)
    four = capacity.max_transformer_layers(4, 16 * GiB, 32, 32, True, seq_len=128, upper=256)
    naive = capacity.max_transformer_layers(1, 16 * GiB, 32, 1, False, seq_len=128, upper=256)
    assert 0 < naive <= one < four


def test_plan_memory_rejects_a_bad_balance():
    recs = layer_records("transformer_l", num_layers=3, seq_len=16)
    with pytest.raises(ValueError, match="sum to 5"):
        plan_memory(recs, [2, 2], GiB, 4)
    with pytest.raises(ValueError, match="divisible"):
        plan_memory(recs, [5], GiB, 5, 2)


def test_cli_memory_and_search(capsys):
    assert main(["memory", "--model", "transformer_l", "--num-layers", "1663", "-K", "128",
                 "--memory-gib", "16", "--batch", "32", "--seq-len", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == pytest.approx(83.88e9, rel=1e-3) and len(out["partitions"]) == 128
    assert main(["search", "--model", "amoebanet_d", "--num-layers", "6", "--image-size", "32",
                 "-K", "2", "--memory-gib", "0.05", "--batch", "8"]) == 0
    assert "max_num_filters=" in capsys.readouterr().out
    assert main(["memory", "--model", "amoebanet_d", "--num-layers", "7"]) == 2


def test_cli_memory_too_many_partitions_points_to_the_papers_size(capsys):
    assert main(["memory", "--model", "transformer_l", "-K", "128"]) == 2
    err = capsys.readouterr().err
    assert "3-layer member" in err and "--num-layers 1663 (83.9B)" in err


def test_cli_memory_restates_its_assumptions(capsys):
    assert main(["memory", "--model", "transformer_l", "--num-layers", "13", "-K", "4", "--batch", "8",
                 "--microbatches", "4", "--seq-len", "64"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("assumes: model=transformer_l, K=4, batch=8, M=4, num_layers=13, seq_len=64")
    assert main(["memory", "--model", "amoebanet_d", "--num-filters", "32", "-K", "2", "--json"]) == 0
    assumed = json.loads(capsys.readouterr().out)["assumptions"]
    assert (assumed["image_size"], assumed["batch"], assumed["M"]) == (224, 128, 128)

"""The one saved-activation counting rule (``gpipe_lab.pipeline.measuring.saved_bytes``) and the places that count with it."""

from __future__ import annotations

import torch
from torch import nn

from gpipe_lab.pipeline.measuring.saved_bytes import SavedBytes, storage_keys


def _count(fn, *args, excluded=frozenset(), boundary=()) -> SavedBytes:
    counter = SavedBytes(excluded, boundary)
    with torch.enable_grad(), counter.hooks():
        fn(*args)
    return counter


def test_views_count_their_own_elements_and_one_storage_at_most_once():
    big = torch.randn(8, 6, requires_grad=True)
    x = big * 1.0  # not a leaf: an activation
    # a micro-batch view counts its rows, not the whole batch's storage
    assert _count(lambda: x[:2].sin()).total == 2 * 6 * 4
    # the three views of one projection together are the storage, once
    assert _count(lambda: [t.sin() for t in x.chunk(3, dim=1)]).total == 8 * 6 * 4
    # the same view saved twice, and a second view over the same elements, do not count again
    assert _count(lambda: (x.sin(), x.cos(), x.view(48).sin())).total == 8 * 6 * 4


def test_parameters_frozen_ones_and_their_views_are_not_activations():
    layer = nn.Linear(5, 3)
    layer.weight.requires_grad_(False)  # frozen: saved (for the input's gradient) but still a weight
    x = torch.randn(4, 5, requires_grad=True)  # Linear saves its weight (a view, weight.t()), not x
    assert _count(layer, x, excluded=storage_keys(layer.parameters())).total == 0
    assert _count(layer, x).total == layer.weight.numel() * 4


def test_boundary_tensors_are_skipped_and_on_add_sees_every_increase():
    x = torch.randn(4, 5, requires_grad=True)
    seen: list[int] = []
    counter = SavedBytes(boundary=[x], on_add=seen.append)
    with counter.hooks():
        (x.sin() * x.cos()).sum()
    assert counter.total == sum(seen) == 2 * 4 * 5 * 4  # sin's and cos's outputs; x itself skipped


def test_meta_counts_like_cpu():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    meta = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)).to("meta")
    cpu = _count(block, torch.randn(3, 6), excluded=storage_keys(block.parameters())).total
    on_meta = _count(meta, torch.empty(3, 6, device="meta"), excluded=storage_keys(meta.parameters())).total
    assert cpu == on_meta == 3 * (6 + 12 + 12) * 4


def test_layer_costs_and_the_memory_benchmark_count_alike():
    from benchmarks import bench_common, bench_memory

    from gpipe_lab.pipeline.measuring.costs import layer_costs

    work = bench_common.make_workload("mlp", bench_common.SIZES["smoke"])
    part = work.module[:3]
    x = work.inputs[:4]
    per_layer = layer_costs(part, "activation_bytes", x)
    assert bench_memory.saved_bytes(part, x, False, work, work.targets[:4]) == sum(per_layer) > 0

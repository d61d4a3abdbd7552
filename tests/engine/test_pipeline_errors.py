"""Bad input is refused with a clear message naming the value and what is allowed.

A layer that fails mid-step is tested in test_reliability_faults.py (every stage,
phase and schedule); a NaN/inf step in test_nonfinite.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import balance_by_cost
from helpers.models import mlp


@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(module=nn.Linear(2, 2), partitions=1), TypeError, "nn.Sequential"),
    (dict(balance=[2, 2]), ValueError, "sums to 4 but the module has 6 layers"),
    (dict(balance=[3, 0, 3]), ValueError, r"balance: must be a non-empty list of positive layer counts, got \[3, 0, 3\]"),
    (dict(balance=[3, -1, 4]), ValueError, "balance: must be a non-empty list of positive layer counts"),
    (dict(partitions=7), ValueError, "partitions: 7 partitions but the module has only 6 layers"),
    (dict(partitions=0), ValueError, "partitions: must be an integer >= 1, got 0"),
    (dict(partitions=3, devices=["cpu", "cpu"]), ValueError, "3 partitions need 3 devices, got 2"),
    (dict(partitions=2, chunks=0), ValueError, "chunks: must be an integer >= 1, got 0"),
    (dict(partitions=2, checkpoint="sometimes"), ValueError, "checkpoint: must be one of .*, got 'sometimes'"),
    (dict(partitions=2, schedule="pipedream"), ValueError, "schedule: must be one of .*, got 'pipedream'"),
    (dict(), ValueError, "either balance"),
    (dict(balance=[3, 3], partitions=3), ValueError, r"balance: \[3, 3\] has 2 entries but partitions=3"),
    (dict(partitions=2, timeout=0), ValueError, "timeout: must be a finite number of seconds > 0, got 0"),
    (dict(partitions=2, cost=[1.0, 2.0]), ValueError, "got 2 layer costs for a module of 6 layers"),
    (dict(partitions=2, cost="flops"), ValueError, "cost 'flops' is measured on a sample batch"),
])
def test_bad_construction(kwargs, error, fragment):
    kwargs.setdefault("module", mlp())
    with pytest.raises(error, match=fragment):
        GPipe(**kwargs)


def test_shared_parameters_across_partitions_are_refused():
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    with pytest.raises(ValueError, match="shared parameters cannot cross partitions"):
        GPipe(nn.Sequential(first, nn.ReLU(), last), balance=[2, 1])
    GPipe(nn.Sequential(first, nn.ReLU(), last), balance=[3])  # same partition is fine


def test_empty_batch_is_refused():
    pipe = GPipe(mlp(), partitions=2, chunks=8)
    with pytest.raises(ValueError, match="chunks must be between 1 and the batch size 0"):
        pipe.train_step(torch.randn(0, 8), torch.randn(0, 8), F.mse_loss)


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"x": x}


def test_non_tensor_between_partitions():
    pipe = GPipe(nn.Sequential(nn.Linear(8, 8), ReturnsDict(), nn.Identity()), balance=[1, 1, 1], chunks=2)
    with pytest.raises(TypeError, match="partition 1 output.*dict"):
        pipe.train_step(torch.randn(4, 8), torch.randn(4, 8), F.mse_loss)


def test_balance_by_cost_minimizes_the_largest_partition():
    assert balance_by_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_by_cost([10, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balance_by_cost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]
    assert max(sum(p) for p in _parts([1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 2, 2])) == 17
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 partitions"):
        balance_by_cost([1, 1], 3)


def _parts(costs, balance):
    out, i = [], 0
    for b in balance:
        out.append(costs[i:i + b])
        i += b
    return out


def test_automatic_balance_uses_parameter_count():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert GPipe(model, partitions=2).balance == [1, 3]  # the default without a sample: parameters
    assert GPipe(model, partitions=2, cost=[1, 1, 1, 1]).balance == [2, 2]
    assert GPipe(model, partitions=2, cost=lambda layer: 1.0).balance == [2, 2]


def test_automatic_balance_default_is_flops_on_a_sample():
    # a table of many parameters and no FLOPs: by parameters it is a stage alone, by FLOPs nearly free
    model = nn.Sequential(nn.Embedding(1000, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 64))
    sample = torch.randint(0, 1000, (4, 5))
    assert GPipe(model, partitions=2, cost="params").balance == [1, 3]
    assert GPipe(model, partitions=2, sample=sample).balance == [3, 1]
    assert GPipe(model, partitions=2, sample=sample).balance == GPipe(model, partitions=2, cost="flops",
                                                                      sample=sample).balance
    assert GPipe(model, partitions=2).balance == [1, 3]  # no sample: parameters, the one cost known unrun


def test_a_layer_listed_twice_is_applied_twice():
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(nn.Linear(8, 8), shared, nn.Tanh(), shared, nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    expected = F.mse_loss(model(x), y).detach()
    pipe = GPipe(model, balance=[1, 3, 1], chunks=2)
    assert torch.allclose(pipe.train_step(x, y, F.mse_loss), expected, atol=1e-6)
    with pytest.raises(ValueError, match="shared parameters cannot cross partitions"):
        GPipe(model, balance=[2, 3], chunks=2)


def test_options_object_and_keywords_agree_and_keywords_win():
    from gpipe_lab.pipeline import OptionError, PipelineOptions

    opts = PipelineOptions(partitions=2, chunks=2, checkpoint="never", schedule="1f1b")
    pipe = GPipe(mlp(), options=opts, chunks=3)
    assert (pipe.chunks, pipe.checkpoint, pipe.schedule, len(pipe.partitions)) == (3, "never", "1f1b", 2)
    assert opts.chunks == 2  # the caller's object is not changed
    assert GPipe(mlp(), partitions=2).chunks == PipelineOptions().chunks == 4
    with pytest.raises(OptionError, match="chunks: must be an integer >= 1, got 0"):
        GPipe(mlp(), options=opts.replace(chunks=0))
    with pytest.raises(OptionError, match="options: must be a PipelineOptions, got dict"):
        GPipe(mlp(), options={"chunks": 2})

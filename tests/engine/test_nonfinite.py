"""The non-finite step policy (local transport) and its cheap NaN/inf check.

The distributed transport's agreement on the verdict is tested in
tests/distributed/test_distributed.py (every rank raises or skips alike).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import NonFiniteError, all_finite


def test_all_finite_detects_nan_and_inf() -> None:
    ok = torch.ones(1000)
    assert all_finite([ok, None, torch.zeros(3)])
    assert all_finite([])
    nan = torch.ones(10)
    nan[3] = float("nan")
    assert not all_finite([ok, nan])
    assert not all_finite([torch.tensor([float("inf"), -float("inf")])])  # the sum is nan
    assert not all_finite([torch.tensor([1.0, -float("inf")])])


def test_all_finite_is_not_fooled_by_a_sum_that_overflows() -> None:
    huge = torch.full((4,), 3e38)  # finite elements, infinite sum
    assert all_finite([huge])
    assert all_finite([torch.full((100_000,), 60000.0, dtype=torch.float16)])
    half = torch.ones(8, dtype=torch.bfloat16)
    half[0] = float("nan")
    assert not all_finite([half])


class Blowup(nn.Module):
    """Multiplies by inf on demand: a non-finite loss."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


def test_nonfinite_loss_raise_names_step_and_skip_drops_the_step():
    blow = Blowup()
    model = nn.Sequential(nn.Linear(8, 8), blow, nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = GPipe(model, balance=[2, 1], chunks=2)
    pipe.train_step(x, y, F.mse_loss)
    blow.factor = float("inf")
    with pytest.raises(NonFiniteError, match="step 1: loss is (nan|inf)"):
        pipe.train_step(x, y, F.mse_loss)
    skipping = GPipe(model, balance=[2, 1], chunks=2, nonfinite="skip")
    skipping.train_step(x, y, F.mse_loss)
    assert skipping.last_step_skipped and skipping.skipped_steps == 1
    assert all(p.grad is None for p in model.parameters())
    blow.factor = 1.0
    skipping.train_step(x, y, F.mse_loss)
    assert not skipping.last_step_skipped
    with pytest.raises(ValueError, match="nonfinite: must be one of .*, got 'maybe'"):
        GPipe(model, partitions=2, nonfinite="maybe")


def test_nonfinite_gradient_names_the_stage():
    from helpers.faults import InfGrad

    class Layer(nn.Module):
        def forward(self, x):
            return InfGrad.apply(x)

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Layer(), nn.Linear(8, 8))
    pipe = GPipe(model, balance=[2, 2], chunks=2)
    with pytest.raises(NonFiniteError, match="gradients of stage 0 are not finite"):
        pipe.train_step(torch.randn(4, 8), torch.randn(4, 8), F.mse_loss)


def test_ignore_policy_returns_the_nonfinite_loss_and_keeps_the_gradients():
    blow = Blowup()
    blow.factor = float("inf")
    model = nn.Sequential(nn.Linear(8, 8), blow, nn.Linear(8, 8))
    pipe = GPipe(model, balance=[2, 1], chunks=2, nonfinite="ignore")
    loss = pipe.train_step(torch.randn(4, 8), torch.randn(4, 8), F.mse_loss)
    assert not torch.isfinite(loss) and not pipe.last_step_skipped
    assert model[0].weight.grad is not None

"""Global-norm clipping on the local transport equals ``torch.nn.utils.clip_grad_norm_`` unpipelined.

(The distributed transport's counterpart: tests/distributed/test_gpu_link_memory.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline import GPipe, clip_grad_norm_


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping, and a bound above the norm (no change)
def test_local_clipping_equals_clip_grad_norm_on_the_unpipelined_model(max_norm: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    pipe = GPipe(model, partitions=3, chunks=4)
    pipe.train_step(x, y, F.mse_loss)
    norm = pipe.clip_grad_norm_(max_norm)
    F.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def test_half_gradients_are_normed_in_float32_without_overflow() -> None:
    p = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)  # squares overflow float16
    norm = clip_grad_norm_([p], 1.0)
    assert norm.dtype == torch.float32 and torch.isclose(norm, torch.tensor(120000.0))
    assert torch.isclose(p.grad.float().norm(), torch.tensor(1.0), rtol=1e-2)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_max_norm_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ValueError, match="max_norm must be a positive finite number"):
        clip_grad_norm_([nn.Parameter(torch.ones(1))], bad)

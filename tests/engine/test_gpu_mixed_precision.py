"""bf16 / fp16 autocast in the direct weight-gradient path (gpipe-bw): used, and equal to autograd's W."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.stage import weight_gradients as wg


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4, bias=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_direct_weight_gradients_run_under_autocast(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[bool] = []
    original = wg.linear_weight_grads

    def spy(*args: object) -> bool:
        used.append(original(*args))
        return used[-1]

    monkeypatch.setattr(wg, "linear_weight_grads", spy)
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    ref = mlp()
    with torch.autocast("cpu", dtype=dtype):
        nn.functional.mse_loss(ref(x).float(), y).backward()
        model = mlp()
        GPipe(model, partitions=2, chunks=4, schedule="gpipe-bw").train_step(
            x, y, lambda out, t: nn.functional.mse_loss(out.float(), t))
    assert used and all(used), "the direct path refused an autocast Linear"
    for a, b in zip(ref.parameters(), model.parameters()):
        assert b.grad.dtype == torch.float32
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-2, atol=2e-2)


def test_full_precision_still_equals_autograd_exactly() -> None:
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    ref, model = mlp(), mlp()
    nn.functional.mse_loss(ref(x), y).backward()
    GPipe(model, partitions=2, chunks=4, schedule="gpipe-bw").train_step(x, y, nn.functional.mse_loss)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)

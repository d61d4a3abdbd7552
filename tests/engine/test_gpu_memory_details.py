"""Memory details: dropout keeps a bool mask, deferred BatchNorm makes no float64 copy of its input."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpipe_lab.pipeline import DeferredBatchNorm, StageDropout
from gpipe_lab.pipeline.stage.random_replay import RandomReplay


def saved_bytes(fn: Any, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.dtype, int]]]:
    """``fn(x)`` and the (dtype, bytes) of every tensor autograd saved for its backward."""
    saved: list[tuple[torch.dtype, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, saved


class Allocations(TorchDispatchMode):
    """Records dtype and size of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((t.dtype, t.numel()))
        return out


def test_stage_dropout_saves_a_bool_mask_and_drops_as_before() -> None:
    x = torch.randn(64, 32, requires_grad=True)
    drop = StageDropout(0.25).train()
    torch.manual_seed(5)
    out, saved = saved_bytes(drop, x)
    assert saved and all(dtype == torch.bool for dtype, _ in saved), saved
    assert sum(b for _, b in saved) == x.numel()  # one byte an element, not four
    torch.manual_seed(5)
    keep = torch.empty_like(x).bernoulli_(0.75)  # the same draw, the float way
    torch.testing.assert_close(out, x * keep / 0.75, rtol=0, atol=1e-6)
    out.sum().backward()
    torch.testing.assert_close(x.grad, keep / 0.75, rtol=0, atol=1e-6)


def test_replayed_native_dropout_returns_a_bool_mask() -> None:
    x = torch.randn(16, 8)
    gen = torch.Generator().manual_seed(3)
    with RandomReplay(gen):
        out, mask = torch.ops.aten.native_dropout(x, 0.5, True)
    assert mask.dtype == torch.bool
    torch.testing.assert_close(out, torch.where(mask, x * 2.0, torch.zeros(())))


def test_deferred_batchnorm_makes_no_float64_copy_of_its_input() -> None:
    x = torch.randn(32, 6, 5, 5)
    bn = DeferredBatchNorm(6).train()
    with Allocations() as seen:
        bn(x)
    big64 = [n for dtype, n in seen.made if dtype == torch.float64 and n >= x.numel()]
    assert not big64, f"float64 tensors of the input's size: {big64}"


def test_deferred_batchnorm_statistics_stay_exact_with_a_large_offset() -> None:
    torch.manual_seed(0)
    parts = [torch.randn(50, 4) * 0.01 + 1000.0 + k for k in range(4)]
    bn = DeferredBatchNorm(4, momentum=None).train()
    for p in parts:
        bn(p)
    assert bn.commit()
    whole = torch.cat(parts).double()
    torch.testing.assert_close(bn.running_mean.double(), whole.mean(0), rtol=0, atol=1e-4)
    torch.testing.assert_close(bn.running_var.double(), whole.var(0), rtol=1e-4, atol=1e-6)


def test_deferred_batchnorm_matches_batchnorm_with_cumulative_momentum() -> None:
    torch.manual_seed(1)
    ref, bn = nn.BatchNorm1d(3, momentum=None), DeferredBatchNorm(3, momentum=None)
    for _ in range(3):
        x = torch.randn(20, 3) * 2 + 1
        ref(x)
        bn(x[:10]), bn(x[10:])
        bn.commit()
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 3

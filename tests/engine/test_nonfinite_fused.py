"""The step's non-finite verdict: one fused check per device and dtype, none under "ignore"."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline.step import core, nonfinite
from gpipe_lab.pipeline.step.nonfinite import gradient_flag

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of tensors each call of the fused kernel judged (the fused path taken on the
    CPU too, which otherwise reads each tensor with aminmax: ``nonfinite.FUSED_DEVICE_TYPES``)."""
    calls: list[int] = []
    monkeypatch.setattr(nonfinite, "FUSED_DEVICE_TYPES", {"cpu", "cuda"})
    original = torch._foreach_norm

    def counted(tensors, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(tensors))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    yield calls


def grads(dtype: torch.dtype, bad: float | None, where: int = 13) -> list[torch.Tensor]:
    torch.manual_seed(0)
    out = [torch.randn(3 + i % 4, 2, dtype=dtype) for i in range(20)]
    if bad is not None:
        out[where][1, 1] = bad
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_one_bad_element_among_many_gradients_is_found_by_one_kernel(dtype, bad, fused_calls) -> None:
    found = gradient_flag(grads(dtype, bad))
    assert found is not None and found.item() > 0
    assert fused_calls == [20]  # one call for the whole group, not one per tensor


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_gradients_pass_and_keep_every_bit(dtype, fused_calls) -> None:
    tensors = grads(dtype, None)
    tensors[3][0, 0] = torch.finfo(dtype).max  # a sum or a norm would overflow: still finite
    before = [t.clone() for t in tensors]
    versions = [t._version for t in tensors]
    flag = gradient_flag([None, *tensors, torch.zeros(0, dtype=dtype)])
    assert flag is not None and flag.item() == 0 and flag.dtype == torch.float64
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors, before))
    # read-only: no gradient is written, not even with its own value (a pass over all of them)
    assert [t._version for t in tensors] == versions
    assert fused_calls == [20]


def test_each_dtype_is_one_group_and_other_gradients_still_count(fused_calls) -> None:
    mixed = grads(torch.float32, None) + grads(torch.float64, None) + grads(torch.bfloat16, float("nan"), 2)
    assert gradient_flag(mixed).item() > 0  # type: ignore[union-attr]
    assert sorted(fused_calls) == [20, 20, 20]
    fused_calls.clear()
    ints = torch.tensor([1, 2])  # not a dtype the kernel takes: judged apart, finite
    complex_bad = torch.tensor([complex(float("nan"), 0.0)])
    assert gradient_flag([ints]).item() == 0  # type: ignore[union-attr]
    assert gradient_flag([torch.ones(2), complex_bad]).item() > 0  # type: ignore[union-attr]
    assert gradient_flag([None]) is None


def pipeline(policy: str) -> GPipe:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    return GPipe(model, partitions=3, chunks=2, nonfinite=policy)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_step_judges_each_stage_with_one_kernel_and_one_read(policy, fused_calls, monkeypatch) -> None:
    reads: list[int] = []
    original = core.read_verdict
    monkeypatch.setattr(core, "read_verdict", lambda v: reads.append(1) or original(v))
    pipe = pipeline(policy)
    pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss)
    assert fused_calls == [4, 4, 4] and len(reads) == 1  # 3 stages, 2 layers (4 tensors) each


def test_ignore_checks_nothing_and_reads_nothing(fused_calls, monkeypatch) -> None:
    reads: list[int] = []
    monkeypatch.setattr(core, "read_verdict", lambda v: reads.append(1) or [])
    pipe = pipeline("ignore")
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = pipe.train_step(x, y, F.mse_loss)
    pipe.module.zero_grad()
    assert loss.item() == pytest.approx(F.mse_loss(pipe.module(x), y).item(), abs=1e-6)
    pipe(x).sum().backward()  # the pipe(x) path ends the step the same way
    assert fused_calls == [] and reads == [] and not pipe.last_step_skipped


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [None, float("inf"), -float("inf"), float("nan")])
def test_cpu_gradients_are_read_by_aminmax_and_keep_every_bit(dtype, bad, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors, *a, **k: calls.append(len(tensors)))
    gs = grads(dtype, bad)
    before = [(g.clone(), g._version) for g in gs]
    found = gradient_flag(gs)
    assert found is not None and (found.item() > 0) == (bad is not None)
    assert calls == []  # the CPU's fast read-only pass, not foreach_norm's slow CPU kernel
    for g, (b, v) in zip(gs, before, strict=True):
        torch.testing.assert_close(g, b, rtol=0, atol=0, equal_nan=True)
        assert g._version == v

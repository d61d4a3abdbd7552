"""Deferred BatchNorm: a training-mode forward is one mini-batch, as for ``nn.BatchNorm``.

The call sequence forward (training mode, no backward), then ``train_step``,
then evaluation gives the running statistics and eval outputs of
``nn.BatchNorm`` on the unpipelined module for the same calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab import GPipe
from gpipe_lab.pipeline import DeferredBatchNorm, commit_forward
from gpipe_lab.pipeline.stage.context import microbatch_context

pytestmark = pytest.mark.timeout(120)


def batches() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 6, generator=g) * (1 + i) + i for i in range(4)]


def pipelined(bn: DeferredBatchNorm, x: Tensor, chunks: int, recompute: bool) -> None:
    """What a stage does with one mini-batch: each micro-batch, then its recompute."""
    for mb in x.chunk(chunks):
        with microbatch_context(torch.Generator().manual_seed(0)):
            bn(mb)
        if recompute:
            with microbatch_context(torch.Generator().manual_seed(0), recomputing=True):
                bn(mb)


@pytest.mark.parametrize("chunks", [1, 4])
def test_forward_then_step_then_eval_matches_batchnorm(chunks: int) -> None:
    forward_x, step_x, eval_x, _ = batches()
    reference = nn.BatchNorm1d(6)
    deferred = DeferredBatchNorm.convert(nn.BatchNorm1d(6))
    reference(forward_x)  # a training-mode forward updates the running statistics once
    pipelined(deferred, forward_x, chunks, recompute=False)
    assert commit_forward(deferred) == 1
    assert commit_forward(deferred) == 0  # nothing pending any more
    reference(step_x)  # a training step
    pipelined(deferred, step_x, chunks, recompute=True)
    assert deferred.commit()
    torch.testing.assert_close(deferred.running_mean, reference.running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(deferred.running_var, reference.running_var, atol=1e-6, rtol=1e-6)
    assert int(deferred.num_batches_tracked) == int(reference.num_batches_tracked) == 2
    reference.eval()
    deferred.eval()
    torch.testing.assert_close(deferred(eval_x), reference(eval_x), atol=1e-5, rtol=1e-5)
    assert commit_forward(deferred) == 0  # an eval forward accumulates nothing


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.Linear(8, 2))


@pytest.mark.parametrize("chunks", [1, 4])
def test_through_gpipe(chunks: int) -> None:
    forward_x, step_x, eval_x, _ = batches()
    target = torch.randn(16, 2)
    reference = model()
    reference(forward_x)
    F.mse_loss(reference(step_x), target).backward()
    reference.eval()
    expected = reference(eval_x)

    net = model()
    pipe = GPipe(net, balance=[3, 3], chunks=chunks, deferred_batch_norm=True, retain_cpu_memory=False)
    pipe.train()
    with torch.no_grad():
        pipe(forward_x)  # a training-mode forward commits its statistics, as nn.BatchNorm's call does
    pipe.train_step(step_x, target, F.mse_loss)
    pipe.eval()
    first, ref_first = net[1], reference[1]
    torch.testing.assert_close(first.running_mean, ref_first.running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(first.running_var, ref_first.running_var, atol=1e-6, rtol=1e-6)
    assert int(first.num_batches_tracked) == 2
    if chunks == 1:  # later BatchNorms see micro-batch-normalized inputs when M > 1
        torch.testing.assert_close(pipe(eval_x), expected, atol=1e-5, rtol=1e-5)


def test_differentiable_forward_commits_once_in_the_forward() -> None:
    forward_x, _, eval_x, _ = batches()
    reference = model()
    reference(forward_x).square().mean().backward()

    net = model()
    pipe = GPipe(net, balance=[3, 3], chunks=1, deferred_batch_norm=True, retain_cpu_memory=False,
                 checkpoint="always")
    pipe.train()
    out = pipe(forward_x)
    first, ref_first = net[1], reference[1]
    assert int(first.num_batches_tracked) == 1  # already after the forward
    out.square().mean().backward()  # the recompute in backward adds nothing
    assert int(first.num_batches_tracked) == 1
    torch.testing.assert_close(first.running_mean, ref_first.running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(first.running_var, ref_first.running_var, atol=1e-6, rtol=1e-6)

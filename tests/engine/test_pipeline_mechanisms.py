"""Re-materialization with dropout, deferred BatchNorm, determinism, timeline, memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import DeferredBatchNorm, StageDropout, analytic_bubble
from helpers.models import grads, mlp


def dropout_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.3),
                         nn.Linear(32, 8))


def run_dropout(checkpoint: str, seed: int = 123, partitions: int = 3, chunks: int = 4):
    model = dropout_model()
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(5)), torch.zeros(16, 8)
    pipe = GPipe(model, partitions=partitions, chunks=chunks, checkpoint=checkpoint, seed=seed,
                 threads_per_stage=1)  # compared bitwise: not the load-dependent default
    loss = pipe.train_step(x, y, F.mse_loss)
    return loss, grads(model)


def test_dropout_is_swapped_for_the_stage_generator_version():
    model = dropout_model()
    GPipe(model, partitions=2)
    assert sum(isinstance(m, StageDropout) for m in model.modules()) == 2
    assert not any(type(m) is nn.Dropout for m in model.modules())


def test_dropout_masks_identical_with_and_without_recompute():
    loss_a, grads_a = run_dropout("always")
    loss_n, grads_n = run_dropout("never")
    assert torch.equal(loss_a, loss_n)
    for a, n in zip(grads_a, grads_n):
        assert torch.allclose(a, n, atol=1e-6)
    # the masks really are random: another seed gives another loss
    loss_other, _ = run_dropout("never", seed=7)
    assert not torch.equal(loss_other, loss_n)


def test_same_seed_is_bitwise_deterministic_over_steps():
    def losses():
        model = dropout_model()
        pipe = GPipe(model, partitions=3, chunks=4, seed=3, threads_per_stage=1)  # not the load-dependent default
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(16, 8)
        out = []
        for _ in range(5):
            opt.zero_grad()
            out.append(pipe.train_step(x, y, F.mse_loss).item())
            opt.step()
        return out

    first = losses()
    assert first == losses()
    assert len(set(first)) == len(first)  # dropout differs per step


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 2))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_deferred_batch_norm_running_stats_equal_full_batch(checkpoint):
    x, y = torch.randn(12, 3, 6, 6) * 2 + 1, torch.randint(0, 2, (12,))
    reference = bn_model()
    reference(x)
    model = bn_model()
    pipe = GPipe(model, balance=[2, 3, 2], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
    pipe.train_step(x, y, F.cross_entropy)
    bn = model[1]
    assert isinstance(bn, DeferredBatchNorm)
    assert torch.allclose(bn.running_mean, reference[1].running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, reference[1].running_var, atol=1e-6)
    assert int(bn.num_batches_tracked) == 1
    # a micro-batch is normalized with its own statistics
    mb = x[:3]
    own = F.batch_norm(model[0](mb), None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    assert torch.allclose(bn(model[0](mb)), own, atol=1e-6)


def test_deferred_batch_norm_keeps_the_parameters_of_the_original():
    model = bn_model()
    weight = model[1].weight
    GPipe(model, partitions=2, deferred_batch_norm=True)
    assert model[1].weight is weight


def test_timeline_records_every_action_and_a_bubble():
    model = mlp(depth=4)
    pipe = GPipe(model, partitions=2, chunks=4, checkpoint="except_last")
    pipe.train_step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss)
    tl = pipe.timeline
    kinds = [(e.stage, e.kind) for e in tl.events]
    for stage in range(2):
        assert kinds.count((stage, "F")) == 4
        assert kinds.count((stage, "B")) == 4
        assert kinds.count((stage, "R")) == 3  # except_last: all but the last micro-batch
    assert 0.0 < tl.measured_bubble() < 1.0
    assert all(b > 0 for b in tl.busy())
    assert analytic_bubble(2, 4) == pytest.approx(1 / 5)


def test_memory_counts_saved_activations_per_stage():
    def peak(checkpoint):
        pipe = GPipe(mlp(depth=4, width=64), partitions=2, chunks=4, checkpoint=checkpoint)
        pipe.train_step(torch.randn(64, 64), torch.randn(64, 64), F.mse_loss)
        return [m["peak_activation_bytes"] for m in pipe.memory()]

    never, always = peak("never"), peak("always")
    assert all(a < n for a, n in zip(always, never))
    pipe = GPipe(mlp(depth=4, width=64), partitions=2)
    assert [m["parameter_bytes"] for m in pipe.memory()] == [2 * 4 * (64 * 128 * 2 + 128 + 64)] * 2


def test_forward_only_builds_no_graph_even_under_inference_mode():
    model = mlp(depth=4, width=16)
    pipe = GPipe(model, partitions=2, chunks=4)
    x = torch.randn(8, 16)
    with torch.inference_mode():
        out = pipe(x)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.allclose(out, model(x), atol=1e-6)
    assert all(m["peak_activation_bytes"] <= 8 * 16 * 4 for m in pipe.memory())


def test_caller_autocast_reaches_the_stage_threads():
    model = mlp(depth=2, width=16)
    pipe = GPipe(model, partitions=2, chunks=2)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, out = pipe.train_step(x, y, lambda o, t: F.mse_loss(o.float(), t), return_outputs=True)
        expected = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected.float(), atol=1e-2)
    _, out32 = pipe.train_step(x, y, F.mse_loss, return_outputs=True)
    assert out32.dtype == torch.float32


def test_each_schedule_is_built_once_per_microbatch_count(monkeypatch):
    from gpipe_lab.pipeline.step import core

    built = []
    real = core.get_schedule
    monkeypatch.setattr(core, "get_schedule", lambda *a: built.append(a) or real(*a))
    pipe = GPipe(mlp(), partitions=2, chunks=4, schedule="zb-h2")
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(3):
        pipe.train_step(x, y, F.mse_loss)
    pipe.train_step(x[:3], y[:3], F.mse_loss)  # a short batch: M=3, a schedule of its own
    # M=4, M=3; construction builds none (the placement is the schedule's declared one)
    assert [a[2] for a in built if a[0] == "zb-h2"] == [4, 3]

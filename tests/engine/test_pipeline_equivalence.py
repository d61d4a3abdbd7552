"""Loss and gradients of the pipeline equal the unpipelined module's (float32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from helpers.models import grads, mlp, reference_step, tuple_model

TOL = 1e-5


def assert_close(a, b):
    assert torch.allclose(a, b, atol=TOL, rtol=TOL), (a - b).abs().max().item()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("partitions", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("build", [mlp, tuple_model], ids=["tensor", "tuple"])
def test_loss_and_grads_equal_unpipelined(build, chunks, partitions, checkpoint, schedule):
    torch.manual_seed(1)
    x, y = torch.randn(10, 8), torch.randn(10, 8)  # 10 samples: M=3 and M=8 split unevenly
    ref_loss, ref_grads = reference_step(build(), x, y, F.mse_loss)
    model = build()
    pipe = GPipe(model, partitions=partitions, chunks=chunks, checkpoint=checkpoint, schedule=schedule)
    loss = pipe.train_step(x, y, F.mse_loss)
    assert_close(loss, ref_loss)
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)


def test_tuple_inputs_and_input_gradient():
    """A tuple input works, and an input that requires grad gets its gradient back."""
    model = nn.Sequential(nn.Identity(), *list(tuple_model())[2:])
    a = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(6, 8, requires_grad=True)
    y = torch.randn(6, 8)
    loss = F.mse_loss(model((a, b)), y)
    ga, gb = torch.autograd.grad(loss, (a, b))
    pipe = GPipe(model, balance=[2, 2, 1], chunks=3)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    pipe_loss = pipe.train_step((a2, b2), y, F.mse_loss)
    assert_close(pipe_loss, loss.detach())
    assert_close(a2.grad, ga)
    assert_close(b2.grad, gb)


def test_token_weighted_loss_is_exact_with_padding():
    """Sum-loss per micro-batch divided by the batch's non-pad count = the full-batch mean."""
    torch.manual_seed(0)
    vocab, pad = 7, 0
    model = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, vocab))
    x = torch.randint(1, vocab, (9, 5))
    y = torch.randint(1, vocab, (9, 5))
    y[:4, 2:] = pad  # very uneven token counts across micro-batches

    def token_sum(logits, target):
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), ignore_index=pad,
                               reduction="sum")

    ref = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1), ignore_index=pad)
    ref.backward()
    ref_grads = grads(model)
    model.zero_grad()
    pipe = GPipe(model, partitions=2, chunks=3)
    loss = pipe.train_step(x, y, token_sum, loss_normalizer=lambda t: (t != pad).sum())
    assert_close(loss, ref.detach())
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)


def test_forward_matches_module_and_training_after_eval():
    model = mlp()
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    expected = model(x).detach()
    pipe = GPipe(model, partitions=3, chunks=4)
    assert_close(pipe(x), expected)
    ref_loss, ref_grads = reference_step(mlp(), x, y, F.mse_loss)
    assert_close(pipe.train_step(x, y, F.mse_loss), ref_loss)
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)


def test_gradients_accumulate_across_steps():
    model = mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = GPipe(model, partitions=2, chunks=4)
    pipe.train_step(x, y, F.mse_loss)
    once = grads(model)
    pipe.train_step(x, y, F.mse_loss)
    for got, want in zip(grads(model), once):
        assert_close(got, 2 * want)


def test_return_outputs_are_the_last_stage_outputs():
    model = mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    expected = model(x).detach()
    pipe = GPipe(model, partitions=2, chunks=3, checkpoint="always")
    _, out = pipe.train_step(x, y, F.mse_loss, return_outputs=True)
    assert_close(out, expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("batch", [1, 3])
def test_batch_smaller_than_chunks_trains_on_fewer_microbatches(batch, schedule):
    """A last batch of fewer samples than chunks runs min(M, batch) micro-batches, exactly."""
    torch.manual_seed(2)
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    ref_loss, ref_grads = reference_step(mlp(), x, y, F.mse_loss)
    model = mlp()
    pipe = GPipe(model, partitions=3, chunks=8, schedule=schedule)
    loss = pipe.train_step(x, y, F.mse_loss)
    assert_close(loss, ref_loss)
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)
    assert pipe.timeline.num_microbatches == batch
    assert {e.microbatch for e in pipe.timeline.events if e.kind == "F"} == set(range(batch))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("partitions,virtual,chunks", [(2, 2, 4), (2, 3, 2), (3, 2, 6)])
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_interleaved_virtual_stages_on_threads_equal_unpipelined(partitions, virtual, chunks, schedule, checkpoint):
    torch.manual_seed(1)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    ref_loss, ref_grads = reference_step(mlp(), x, y, F.mse_loss)
    model = mlp()
    pipe = GPipe(model, partitions=partitions, virtual_stages=virtual, chunks=chunks, schedule=schedule,
                 checkpoint=checkpoint)
    assert len(pipe.partitions) == partitions * virtual and len(pipe.devices) == partitions
    loss = pipe.train_step(x, y, F.mse_loss)
    assert_close(loss, ref_loss)
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)
    assert {e.stage for e in pipe.timeline.events} == set(range(partitions))  # events per rank
    with torch.no_grad():
        assert_close(pipe(x), model(x))


def test_virtual_stages_take_one_balance_entry_per_chunk():
    pipe = GPipe(mlp(), balance=[1, 2, 2, 1], virtual_stages=2, chunks=2)
    assert pipe.num_stages == 2 and [len(p) for p in pipe.partitions] == [1, 2, 2, 1]
    with pytest.raises(ValueError, match="not a multiple of virtual_stages=2"):
        GPipe(mlp(), balance=[1, 2, 3], virtual_stages=2)
    with pytest.raises(ValueError, match="no form with virtual_stages=2"):
        GPipe(mlp(), partitions=2, virtual_stages=2, schedule="zb-h1")

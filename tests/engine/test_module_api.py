"""``GPipe`` as a module a torchgpipe user drops in: differentiable ``pipe(x)``, sequence access.

``out = pipe(x); criterion(out, y).backward()`` gives the unpipelined module's
gradients (parameters and input), with re-materialization and deferred BatchNorm
as in ``train_step``; no_grad / inference_mode / eval keep the forward-only path.
"""

from __future__ import annotations

import pytest
import torch
from differential_cases import Probe  # records (is_checkpointing, is_recomputing) per call
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import DeferredBatchNorm, is_checkpointing, is_recomputing
from helpers.models import grads, mlp, tuple_model

TOL = 1e-5


def assert_close(a, b):
    assert torch.allclose(a, b, atol=TOL, rtol=TOL), (a - b).abs().max().item()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("partitions,chunks", [(1, 1), (2, 4), (3, 3)])
@pytest.mark.parametrize("build", [mlp, tuple_model], ids=["tensor", "tuple"])
def test_backward_through_pipe_call_equals_unpipelined(build, partitions, chunks, checkpoint):
    torch.manual_seed(3)
    x, y = torch.randn(10, 8), torch.randn(10, 8)
    ref = build()
    x_ref = x.clone().requires_grad_()
    F.mse_loss(ref(x_ref), y).backward()
    model = build()
    pipe = GPipe(model, partitions=partitions, chunks=chunks, checkpoint=checkpoint)
    x_pipe = x.clone().requires_grad_()
    out = pipe(x_pipe)
    assert out.requires_grad
    F.mse_loss(out, y).backward()
    for got, want in zip(grads(model), grads(ref)):
        assert_close(got, want)
    assert_close(x_pipe.grad, x_ref.grad)
    recomputed = {e.microbatch for e in pipe.timeline.events if e.kind == "R"}
    assert len(recomputed) == {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    for k in range(partitions):  # every stage ran its own backwards, in fill-drain order
        order = [e.microbatch for e in pipe.timeline.events if e.kind == "B" and e.stage == k]
        assert order == list(reversed(range(chunks)))


def test_a_whole_batch_loss_and_tuple_outputs_get_exact_gradients():
    """A loss that does not split per micro-batch (a norm of the whole output)."""
    torch.manual_seed(4)
    x = torch.randn(6, 8)
    ref = nn.Sequential(*list(tuple_model())[:4])  # ends on a tuple (a, b)
    a, b = ref(x)
    (torch.linalg.norm(a) * b.std()).backward()
    model = nn.Sequential(*list(tuple_model())[:4])
    pipe = GPipe(model, balance=[1, 2, 1], chunks=3)
    pa, pb = pipe(x)
    (torch.linalg.norm(pa) * pb.std()).backward()
    for got, want in zip(grads(model), grads(ref)):
        assert_close(got, want)


def test_deferred_batch_norm_commits_once_per_backward_like_train_step():
    torch.manual_seed(5)
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))

    by_call, by_step = build(), build()
    call = GPipe(by_call, balance=[2, 1], chunks=4, deferred_batch_norm=True)
    step = GPipe(by_step, balance=[2, 1], chunks=4, deferred_batch_norm=True)
    F.mse_loss(call(x), y).backward()
    step.train_step(x, y, F.mse_loss)
    bn_call, bn_step = by_call[1], by_step[1]
    assert isinstance(bn_call, DeferredBatchNorm)
    assert_close(bn_call.running_mean, bn_step.running_mean)
    assert_close(bn_call.running_var, bn_step.running_var)
    assert int(bn_call.num_batches_tracked) == 1
    for got, want in zip(grads(by_call), grads(by_step)):
        assert_close(got, want)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "eval", "layers_eval"])
def test_forward_only_path_builds_no_graph(context):
    model = mlp()
    pipe = GPipe(model, partitions=2, chunks=2)
    x = torch.randn(4, 8)
    if context == "eval":
        pipe.eval()
        out = pipe(x)
    elif context == "layers_eval":  # as Lightning does: the layers' module, not the pipe, goes to eval
        model.eval()
        with torch.inference_mode(), torch.inference_mode(False):
            out = pipe(x)
    elif context == "no_grad":
        with torch.no_grad():
            out = pipe(x)
    else:
        with torch.inference_mode():
            out = pipe(x)
    assert not out.requires_grad and out.grad_fn is None
    assert {e.kind for e in pipe.timeline.events} <= {"F", "wait"}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe-bw"])
def test_schedules_with_the_loss_inside_refuse_backward_through_pipe_call(schedule):
    model = mlp()
    pipe = GPipe(model, partitions=2, chunks=2, schedule=schedule)
    x = torch.randn(4, 8)
    out = pipe(x)
    with torch.no_grad():
        assert_close(out, model(x))  # the values are still right
    with pytest.raises(RuntimeError, match=f"schedule '{schedule}' needs the loss inside the pipeline.*train_step"):
        out.sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_sequence_access_and_read_only_attributes():
    model = mlp(depth=5)
    pipe = GPipe(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=3, checkpoint="never")
    assert len(pipe) == 5
    assert pipe[0] is model[0] and pipe[4] is model[4]
    assert list(pipe) == list(model)
    assert [len(p) for p in pipe.partitions] == [2, 3]
    assert pipe.partitions[1][0] is model[2]
    assert pipe.balance == [2, 3]
    assert pipe.devices == [torch.device("cpu")] * 2
    assert (pipe.chunks, pipe.checkpoint) == (3, "never")
    for name in ("partitions", "balance", "devices", "chunks", "checkpoint"):
        with pytest.raises(AttributeError):
            setattr(pipe, name, getattr(pipe, name))
    pipe.balance.append(1)  # a copy: the pipeline's own balance cannot be changed through it
    assert pipe.balance == [2, 3]


@pytest.mark.parametrize("checkpoint,expected", [
    ("always", {(True, False), (False, True)}),  # torchgpipe's meaning: the replay is not "checkpointing"
    ("never", {(False, False)}),
])
def test_layers_can_tell_a_checkpointed_forward_and_its_replay(checkpoint, expected):
    probe = Probe()
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), probe, nn.Linear(4, 4)), balance=[2, 1], chunks=2,
                 checkpoint=checkpoint)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    assert set(probe.seen) == expected
    assert (is_checkpointing(), is_recomputing()) == (False, False)  # nothing leaks to the caller


def test_a_stale_or_repeated_backward_is_refused_clearly():
    pipe = GPipe(mlp(), partitions=2, chunks=2)
    x = torch.randn(4, 8)
    first = pipe(x)
    second = pipe(x)
    with pytest.raises(RuntimeError, match="ran another step .* before this output's backward"):
        first.sum().backward()
    loss = second.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="can run once"):
        loss.backward()

"""Users' architectures on the local transport (issue 45): each against the unpipelined model.

The shapes users bring and the lab's own models lacked: a ViT front (a class-token
parameter concatenated, a positional embedding added), an in-place first layer of a
stage, an input from the caller's graph, a sparse embedding, attention drawing dropout
after an evaluation pass, targets of another batch size. Each comparison covers the
loss, every parameter's ``.grad``, the input's gradient and the buffers, to 1e-5 in
float32.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.pipeline import GPipe, balance_by_cost
from gpipe_lab.pipeline.measuring.costs import layer_costs
from gpipe_lab.pipeline.step.nonfinite import gradient_flag, nonfinite_flag
from helpers.user_models import (
    Attention,
    ScaleInPlace,
    TorchAttention,
    attention_model,
    inplace_model,
    sparse_model,
    vit,
)

SCHEDULES = ["gpipe", "1f1b", "gpipe-bw", "zb-h1", "zb-h2", "interleaved-1f1b"]
CHECKPOINTS = ["never", "always", "except_last"]


def pipe_of(module: nn.Sequential, schedule: str, balance: list[int], **options: object) -> GPipe:
    """``balance`` as K=2 (or K=3) ranks; interleaved-1f1b gets v=2 with each rank's layers halved."""
    if schedule == "interleaved-1f1b":
        halves = [[n // 2, n - n // 2] for n in balance]
        balance = [h[0] for h in halves] + [h[1] for h in halves]
        if 0 in balance:
            pytest.skip("a rank of one layer cannot hold two chunks")
        options["virtual_stages"] = 2
    return GPipe(module, balance=balance, schedule=schedule, **options)


def assert_same(reference: nn.Module, piped: nn.Module) -> None:
    """Every parameter's gradient (None where the reference's is None) and every buffer."""
    for (name, p), q in zip(reference.named_parameters(), piped.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad.to_dense(), p.grad.to_dense(), atol=1e-5, rtol=1e-5, msg=name)
    for (name, b), c in zip(reference.named_buffers(), piped.buffers()):
        torch.testing.assert_close(c, b, atol=1e-5, rtol=1e-5, msg=name)


def set_grads(module: nn.Module, start: str) -> None:
    """``.grad`` at the step's start: ``none`` (after ``zero_grad()``), ``zeros``, or ``accumulated``."""
    for i, p in enumerate(module.parameters()):
        p.grad = None if start == "none" else torch.zeros_like(p) if start == "zeros" else torch.full_like(p, 0.1 * i)


# ---------------------------------------------------------------- 1: a ViT front, split backward
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("start", ["none", "zeros", "accumulated"])
@pytest.mark.parametrize(("rows", "chunks", "balance"), [(4, 4, [3, 3]), (3, 8, [3, 3]), (4, 4, [2, 4])])
def test_vit_gradients_equal_unpipelined_whatever_grad_holds_at_the_start(
        schedule: str, start: str, rows: int, chunks: int, balance: list[int]) -> None:
    """gpipe-bw with .grad None gave the positional embedding a wrong gradient: W's autograd
    call let it adopt a view of a gradient B had captured, which the next accumulation wrote."""
    reference, piped = vit(), vit()
    x, y = torch.randn(rows, 4, 6), torch.randn(rows, 3)
    set_grads(reference, start)
    set_grads(piped, start)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    pipe = pipe_of(piped, schedule, balance, chunks=chunks)
    for _ in range(3):  # the split schedules' W order varies with thread timing: a few steps
        loss = pipe.train_step(x, y, F.mse_loss)
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        assert_same(reference, piped)
        set_grads(piped, start)
        # the next step starts where the reference's did
        if start == "accumulated":
            continue
        for p in piped.parameters():
            p.grad = None if start == "none" else torch.zeros_like(p)


# ---------------------------------------------------------------- 2: mode transitions
@pytest.mark.parametrize("kind", [Attention, TorchAttention])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_an_evaluation_pass_before_training_leaves_attention_dropout_replayable(
        kind: type[nn.Module], checkpoint: str) -> None:
    """eval -> forward -> train -> train_step raised UnreplayableRandomError: pipe.eval() did not reach
    the stages' own containers, so the eval pass was probed as the training mode's probe."""
    x, y = torch.randn(4, 5, 8), torch.randn(4, 5, 2)
    fresh_net, net = attention_model(kind), attention_model(kind)
    fresh = GPipe(fresh_net, balance=[2, 3], chunks=2, checkpoint=checkpoint)
    expected = fresh.train_step(x, y, F.mse_loss, step=1)
    pipe = GPipe(net, balance=[2, 3], chunks=2, checkpoint=checkpoint)
    pipe.eval()
    with torch.no_grad():
        evaluated = pipe(x)
    net.eval()  # the plain module, in eval mode, on the same layers
    with torch.no_grad():
        torch.testing.assert_close(evaluated, net(x), atol=1e-5, rtol=1e-5)
    pipe.train()
    loss = pipe.train_step(x, y, F.mse_loss, step=1)  # the same step number: the same draws
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert_same(fresh_net, net)
    pipe.eval()  # and back: an evaluation after training is the plain module's
    with torch.no_grad():
        again = pipe(x)
        net.eval()
        torch.testing.assert_close(again, net(x), atol=1e-5, rtol=1e-5)
    pipe.train()
    net.zero_grad()
    fresh_net.zero_grad()
    torch.testing.assert_close(pipe.train_step(x, y, F.mse_loss, step=2),
                               fresh.train_step(x, y, F.mse_loss, step=2), atol=1e-5, rtol=1e-5)
    assert_same(fresh_net, net)


def test_a_framework_setting_only_the_layers_eval_is_a_mode_of_its_own() -> None:
    """Lightning's sanity check calls eval() on the module holding the layers, not on the pipe."""
    x, y = torch.randn(4, 5, 8), torch.randn(4, 5, 2)
    net = attention_model(TorchAttention)
    pipe = GPipe(net, balance=[2, 3], chunks=2, checkpoint="always")
    net.eval()
    with torch.no_grad():
        pipe(x)
    net.train()
    assert torch.isfinite(pipe.train_step(x, y, F.mse_loss))
    assert all(s.module.training for s in pipe.stages)


# ---------------------------------------------------------------- 3: an in-place first layer
@pytest.mark.parametrize("first", [nn.ReLU(inplace=True), ScaleInPlace()], ids=["relu", "scale"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_an_in_place_first_layer_of_a_stage_trains_as_unpipelined(
        first: nn.Module, schedule: str, checkpoint: str) -> None:
    """Stages 1 and 2 begin with an in-place layer; the caller's input needs grad too."""
    reference = inplace_model(first)
    piped = copy.deepcopy(reference)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = F.mse_loss(reference(x_ref), y)
    expected.backward()
    pipe = pipe_of(piped, schedule, [1, 2, 2] if schedule != "interleaved-1f1b" else [2, 3], chunks=3,
                   checkpoint=checkpoint)
    loss = pipe.train_step(x_pipe, y, F.mse_loss)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert_same(reference, piped)
    torch.testing.assert_close(x_pipe.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    assert pipe.stages[1].input_writes.writes


def vgg() -> nn.Sequential:
    """A torchvision-style CNN as a Sequential: every activation an in-place ReLU."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1),
                         nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1),
                         nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(8 * 4 * 4, 3))


INPLACE_CUTS = [i for i, layer in enumerate(vgg()) if isinstance(layer, nn.ReLU)]


@pytest.mark.parametrize("cut", INPLACE_CUTS + ["activation_bytes", "output_bytes"])
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_cnn_cut_before_each_in_place_relu_trains_as_unpipelined(cut: int | str, schedule: str) -> None:
    """A cut before each in-place ReLU, and the cuts balance_by_cost makes by activation or output
    bytes (which tend to land there)."""
    x, y = torch.randn(6, 3, 8, 8), torch.randn(6, 3)
    reference, piped = vgg(), vgg()
    if isinstance(cut, str):
        balance = balance_by_cost(layer_costs(piped, cut, sample=x[:2]), 2)
    else:
        balance = [cut, len(piped) - cut]
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    pipe = GPipe(piped, balance=balance, chunks=3, schedule=schedule, checkpoint="except_last")
    torch.testing.assert_close(pipe.train_step(x, y, F.mse_loss), expected, atol=1e-5, rtol=1e-5)
    assert_same(reference, piped)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_an_in_place_first_layer_under_pipe_x_backward(checkpoint: str) -> None:
    reference = inplace_model(ScaleInPlace())
    piped = copy.deepcopy(reference)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = F.mse_loss(reference(x_ref), y)
    expected.backward()
    pipe = GPipe(piped, balance=[1, 2, 2], chunks=3, checkpoint=checkpoint)
    loss = F.mse_loss(pipe(x_pipe), y)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert_same(reference, piped)
    torch.testing.assert_close(x_pipe.grad, x_ref.grad, atol=1e-5, rtol=1e-5)


def test_an_in_place_write_appearing_after_the_first_step_in_a_checkpointed_forward_raises() -> None:
    """A stage learned not to write its input; a later checkpointed forward that writes cannot be
    replayed from the written values: it raises instead of giving a wrong gradient."""

    class Sometimes(nn.Module):
        write = False

        def forward(self, x: Tensor) -> Tensor:
            return x.mul_(2) if self.write else x * 2

    sometimes = Sometimes()
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), sometimes, nn.Linear(4, 2)), balance=[1, 2], chunks=2,
                 checkpoint="always")
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe.train_step(x, y, F.mse_loss)
    sometimes.write = True
    with pytest.raises(RuntimeError, match="stage 1 wrote into its input in place"):
        pipe.train_step(x, y, F.mse_loss)


# ---------------------------------------------------------------- 4: an input from the caller's graph
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_trainable_front_end_outside_the_pipe_gets_plain_gradients(schedule: str, checkpoint: str) -> None:
    """train_step(front(x), ...) with M > 1 back-propagated each micro-batch through the front's graph
    ("backward through the graph a second time"); now the caller's graph runs one backward."""
    torch.manual_seed(0)
    front_ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    body_ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    front, body = copy.deepcopy(front_ref), copy.deepcopy(body_ref)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    expected = F.mse_loss(body_ref(front_ref(x)), y)
    expected.backward()
    pipe = pipe_of(body, schedule, [2, 2], chunks=3, checkpoint=checkpoint)
    loss = pipe.train_step(front(x), y, F.mse_loss)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert_same(front_ref, front)
    assert_same(body_ref, body)


def test_an_in_place_first_layer_on_an_input_from_the_caller_s_graph() -> None:
    torch.manual_seed(0)
    front_ref = nn.Linear(4, 4)
    body_ref = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    front, body = copy.deepcopy(front_ref), copy.deepcopy(body_ref)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    F.mse_loss(body_ref(front_ref(x)), y).backward()
    GPipe(body, balance=[2, 2], chunks=3, checkpoint="except_last").train_step(front(x), y, F.mse_loss)
    assert_same(front_ref, front)
    assert_same(body_ref, body)


# ---------------------------------------------------------------- 5: sparse gradients
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_sparse_gradients_pass_the_nonfinite_check_and_clip_as_torch_does(schedule: str) -> None:
    reference, piped = sparse_model(), sparse_model()
    x, y = torch.randint(0, 10, (6, 3)), torch.randn(6, 2)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    pipe = GPipe(piped, balance=[2, 3], chunks=3, schedule=schedule)  # nonfinite="raise", the default
    loss = pipe.train_step(x, y, F.mse_loss)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert piped[0].weight.grad.is_sparse
    assert_same(reference, piped)
    norm = pipe.clip_grad_norm_(0.1)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1),
                               atol=1e-5, rtol=1e-5)
    assert_same(reference, piped)  # clipped alike


def test_a_non_finite_sparse_gradient_is_found() -> None:
    bad = torch.sparse_coo_tensor([[1, 3]], torch.tensor([[1.0, 2.0], [float("nan"), 0.0]]), (5, 2))
    fine = torch.sparse_coo_tensor([[1, 1]], torch.tensor([[1.0, 2.0], [3.0, 4.0]]), (5, 2))
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 2), (5, 2))
    assert bool(nonfinite_flag([bad])) and not bool(nonfinite_flag([fine]))
    assert nonfinite_flag([empty]) is None
    assert float(gradient_flag([torch.ones(2), bad])) > 0 and float(gradient_flag([torch.ones(2), fine])) == 0
    overflow = torch.sparse_coo_tensor([[2, 2]], torch.tensor([3e38, 3e38]), (5,))  # duplicates sum to inf
    assert bool(nonfinite_flag([overflow]))


# ---------------------------------------------------------------- 6: targets of another batch size
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_targets_of_another_batch_size_are_refused(schedule: str) -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], chunks=4, schedule=schedule)
    with pytest.raises(ValueError, match="targets have batch size 4 but inputs have 8"):
        pipe.train_step(torch.randn(8, 4), torch.randn(4, 2), F.mse_loss)
    assert all(p.grad is None for p in pipe.parameters())  # refused before any stage ran
    pipe.train_step(torch.randn(8, 4), torch.randn(8, 2), F.mse_loss)  # and the pipe still runs


# ---------------------------------------------------------------- minor: RNN checkpoint modes
class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = kind(8, 8, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.rnn(x)[0]


def tagger(kind: type[nn.RNNBase]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Recurrent(kind), nn.Linear(8, 8), Recurrent(kind), nn.Linear(8, 3))


def token_loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, 3), target.reshape(-1), ignore_index=-1, label_smoothing=0.1)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_rnn_checkpoint_modes_agree_to_rounding(kind: type[nn.RNNBase]) -> None:
    """The README's rule: CPU RNN kernels differ under no_grad (a checkpointed micro-batch's first
    forward), so the modes agree to ~1e-9, not bitwise; each equals plain PyTorch to 1e-5."""
    x = torch.randn(6, 7, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (6, 7), generator=torch.Generator().manual_seed(2))
    y[0, :2] = -1  # ignored tokens
    reference = tagger(kind)
    mean_loss = token_loss(reference(x), y)  # the pipe weights each micro-batch by its rows
    grads = {}
    for checkpoint in CHECKPOINTS:
        net = tagger(kind)
        pipe = GPipe(net, balance=[2, 3], chunks=3, checkpoint=checkpoint)
        loss = pipe.train_step(x, y, lambda o, t: token_loss(o, t) * (t != -1).sum(),
                               loss_normalizer=lambda t: (t != -1).sum())
        torch.testing.assert_close(loss, mean_loss, atol=1e-5, rtol=1e-5)
        grads[checkpoint] = [p.grad for p in net.parameters()]
    mean_loss.backward()
    for checkpoint, found in grads.items():
        for p, g in zip(reference.parameters(), found):
            torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5, msg=checkpoint)
    for a, b in zip(grads["always"], grads["never"]):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------- minor: a failing stage stops the others
def test_a_failing_stage_stops_its_neighbours_before_their_next_micro_batch() -> None:
    """Stage 1 raises at micro-batch 0 while stage 0 is inside micro-batch 1's forward. Stage 0 is let
    go only while stage 1's thread leaves its contexts (the unwinding a loaded machine may stretch):
    the failure must be recorded by then, so stage 0 starts no further micro-batch (torchgpipe's
    early stop). It used to be recorded after that unwinding: stage 0 ran micro-batches 2 and 3."""
    forwards: list[int] = []
    holding, release, upstream_left = threading.Event(), threading.Event(), threading.Event()

    class Hold(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            forwards.append(len(forwards))
            if len(forwards) == 2:
                holding.set()
                assert release.wait(30)
            return x

    class Fail(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            assert holding.wait(30)
            raise ValueError("boom")

    # random_replay=False: a probing forward holds the shared generators' lock, and Hold waits inside one
    pipe = GPipe(nn.Sequential(Hold(), Fail()), balance=[1, 1], chunks=4, timeout=5, random_replay=False)
    plain = pipe.channel.rank_context

    @contextmanager
    def rank_context(rank: int, device: torch.device) -> Iterator[None]:
        try:
            with plain(rank, device):
                yield
        except BaseException:
            if rank == 1:  # the failing rank unwinds: stage 0 goes on, and this waits until it has left
                release.set()
                assert upstream_left.wait(30)
            raise
        finally:
            if rank == 0:
                upstream_left.set()

    pipe.channel.rank_context = rank_context  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="boom"):
        pipe.train_step(torch.randn(4, 2), torch.randn(4, 2), F.mse_loss)
    assert forwards == [0, 1]  # micro-batches 2 and 3 never started on stage 0


# ---------------------------------------------------------------- 2, through the Lightning strategy
def test_lightning_sanity_check_then_training_with_attention_dropout() -> None:
    """Lightning's sanity check (eval() of the module holding the layers, a validation forward, then
    train()) before the first training step: the step used to raise UnreplayableRandomError."""
    from gpipe_lab.lightning import GPipeStrategy
    from helpers.strategy import TinyData, TinyRegressor, trainer

    class AttentionRegressor(TinyRegressor):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (2, 4)), Mixer(), nn.Flatten(),
                                        nn.Linear(8, 1))

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(4, 2, dropout=0.3, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            return self.attention(x, x, x, need_weights=False)[0]

    module = AttentionRegressor()
    strategy = GPipeStrategy(partitions=2, chunks=2, balance=[2, 3], checkpoint="always")
    trainer(strategy, max_steps=3, num_sanity_val_steps=1, limit_val_batches=1).fit(module, TinyData())
    assert len(module.losses) == 3 and all(torch.isfinite(torch.tensor(module.losses)))

"""Random replay: every random draw of a stage forward repeats when the micro-batch is recomputed.

For each kind of draw (functional and module dropouts, attention dropout, plain
``torch.rand``-style calls), K in {1, 2, 3} and M in {1, 4}: the gradients with
``checkpoint="always"`` and ``"except_last"`` equal those with ``"never"``, and
two runs with the same seed are bitwise equal. A draw that cannot be replayed
is refused with an error naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab import GPipe
from gpipe_lab.pipeline.stage.context import microbatch_context
from gpipe_lab.pipeline.stage.random_replay import UnreplayableRandomError

pytestmark = pytest.mark.timeout(300)
WIDTH = 16


class Shaped(nn.Module):
    """Applies ``fn`` (or ``layer``) to the [N, 16] activation viewed as ``shape``."""

    def __init__(self, shape: tuple[int, ...], fn: Callable[[Tensor], Tensor] | None = None,
                 layer: nn.Module | None = None) -> None:
        super().__init__()
        self.shape, self.fn, self.layer = shape, fn, layer

    def forward(self, x: Tensor) -> Tensor:
        y = x.reshape(x.shape[0], *self.shape)
        y = self.layer(y) if self.layer is not None else self.fn(y)
        return y.reshape(x.shape[0], WIDTH)


class SelfAttention(nn.Module):
    def __init__(self, attention: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, x, x)[0]


def plain_draws(x: Tensor) -> Tensor:
    noise = (torch.rand(x.shape) + torch.randn(x.shape) + torch.randint(0, 3, x.shape).float()
             + torch.bernoulli(torch.full_like(x, 0.5)) + torch.empty_like(x).normal_()
             + torch.empty_like(x).uniform_() + torch.rand_like(x))
    return x * (1.0 + 0.1 * noise)


def sdpa(x: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(x, x, x, dropout_p=0.3)


KINDS: dict[str, Callable[[], nn.Module]] = {
    "F.dropout": lambda: Shaped((WIDTH,), lambda y: F.dropout(y, 0.3)),
    "F.dropout1d": lambda: Shaped((4, 4), lambda y: F.dropout1d(y, 0.3)),
    "F.dropout2d": lambda: Shaped((4, 2, 2), lambda y: F.dropout2d(y, 0.3)),
    "F.dropout3d": lambda: Shaped((4, 2, 2, 1), lambda y: F.dropout3d(y, 0.3)),
    "nn.Dropout1d": lambda: Shaped((4, 4), layer=nn.Dropout1d(0.3)),
    "nn.Dropout2d": lambda: Shaped((4, 2, 2), layer=nn.Dropout2d(0.3)),
    "nn.Dropout3d": lambda: Shaped((4, 2, 2, 1), layer=nn.Dropout3d(0.3)),
    "nn.AlphaDropout": lambda: nn.AlphaDropout(0.3),
    "nn.FeatureAlphaDropout": lambda: Shaped((4, 4), layer=nn.FeatureAlphaDropout(0.3)),
    "F.scaled_dot_product_attention": lambda: Shaped((2, 4, 2), sdpa),
    "nn.MultiheadAttention": lambda: Shaped(
        (4, 4), layer=SelfAttention(nn.MultiheadAttention(4, 2, dropout=0.3, batch_first=True))),
    "nn.TransformerEncoderLayer": lambda: Shaped(
        (4, 4), layer=nn.TransformerEncoderLayer(4, 2, 8, dropout=0.3, batch_first=True)),
    "torch.rand/randn/randint/bernoulli/normal_/uniform_": lambda: Shaped((WIDTH,), plain_draws),
}


def model(kind: str) -> nn.Sequential:
    """Six layers, a random one in each of the three partitions of K=3."""
    torch.manual_seed(0)
    make = KINDS[kind]
    return nn.Sequential(nn.Linear(8, WIDTH), make(), nn.Linear(WIDTH, WIDTH), make(),
                         nn.Linear(WIDTH, WIDTH), nn.Sequential(make(), nn.Linear(WIDTH, 4)))


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def step(kind: str, partitions: int, chunks: int, checkpoint: str) -> tuple[Tensor, list[Tensor]]:
    net = model(kind)
    # one thread per stage: compared bitwise, so not the default, which follows the machine's load
    pipe = GPipe(net, balance=[6 // partitions] * partitions, chunks=chunks, checkpoint=checkpoint,
                 seed=11, retain_cpu_memory=False, threads_per_stage=1)
    loss = pipe.train_step(*data(), F.mse_loss)
    return loss.detach(), [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("kind", list(KINDS))
def test_recompute_replays_every_draw(kind: str) -> None:
    for partitions in (1, 2, 3):
        for chunks in (1, 4):
            loss, grads = step(kind, partitions, chunks, "never")
            assert all(g.abs().sum() > 0 for g in grads)
            for checkpoint in ("always", "except_last"):
                other_loss, other = step(kind, partitions, chunks, checkpoint)
                assert torch.equal(other_loss, loss), (partitions, chunks, checkpoint)
                for g, h in zip(grads, other):
                    torch.testing.assert_close(h, g, atol=1e-6, rtol=0,
                                               msg=f"K={partitions} M={chunks} {checkpoint}")
    # bitwise repeatable where the most threads interleave
    again_loss, again = step(kind, 3, 4, "except_last")
    repeat_loss, repeat = step(kind, 3, 4, "except_last")
    assert torch.equal(again_loss, repeat_loss)
    assert all(torch.equal(g, h) for g, h in zip(again, repeat))


def test_draws_differ_between_microbatches_and_steps() -> None:
    """The replay does not make dropout degenerate: each (step, micro-batch) gets its own mask."""
    net = nn.Sequential(Shaped((WIDTH,), lambda y: F.dropout(y, 0.5)))
    pipe = GPipe(net, balance=[1], chunks=2, seed=3, retain_cpu_memory=False)
    pipe.train()
    ones = torch.ones(2, WIDTH)
    first, second = pipe(ones).split(1)
    assert not torch.equal(first, second)
    pipe.step_count += 1
    assert not torch.equal(pipe(ones), torch.cat([first, second]))


def test_the_callers_global_generator_is_left_alone() -> None:
    net = model("F.dropout")
    pipe = GPipe(net, balance=[2, 2, 2], chunks=4, checkpoint="always", seed=4, retain_cpu_memory=False)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    pipe.train_step(*data(), F.mse_loss)
    assert torch.equal(torch.get_rng_state(), state)


def test_fused_dropout_is_replayed_with_its_mask() -> None:
    """``native_dropout`` (the accelerators' fused dropout; callable on CPU too) is re-implemented."""
    x = torch.randn(64, 8, requires_grad=True)
    runs = []
    for _ in range(2):
        with microbatch_context(torch.Generator().manual_seed(5)):
            runs.append(torch.ops.aten.native_dropout(x, 0.3, True))
    (out, mask), (again, _) = runs
    assert torch.equal(out, again) and mask.dtype == torch.bool and 0 < mask.float().mean() < 1
    out.sum().backward()
    torch.testing.assert_close(x.grad, mask.float() / 0.7)


def test_ops_reading_the_default_generator_are_reseeded() -> None:
    """Ops without a generator argument (fused attention kernels on GPUs; here native_dropout.out)."""
    x = torch.randn(64, 8)

    def run(seed: int) -> Tensor:
        out, mask = torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
        with microbatch_context(torch.Generator().manual_seed(seed)):
            torch.ops.aten.native_dropout.out(x, 0.3, True, out0=out, out1=mask)
        return out

    state = torch.get_rng_state()
    first, again, other = run(1), run(1), run(2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.get_rng_state(), state)


class CudnnLikeRnn(nn.Module):
    """Calls the cuDNN RNN op, whose dropout state no generator can rewind."""

    def forward(self, x: Tensor) -> Tensor:
        torch.ops.aten._cudnn_rnn(x, [], 0, None, x, None, 0, 4, 0, 1, False, 0.5, True, False, [], None)
        return x


def test_an_unreplayable_draw_is_refused_naming_the_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(UnreplayableRandomError, match=r"CudnnLikeRnn.*dropout=0\.5"):
        with microbatch_context(gen):
            CudnnLikeRnn()(torch.zeros(2, 4))


DISTRIBUTED_KINDS = ("nn.MultiheadAttention", "torch.rand/randn/randint/bernoulli/normal_/uniform_")


def distributed_worker(rank: int, world: int) -> list:
    from gpipe_lab.pipeline.distributed import DistributedGPipe

    out = []
    for kind in DISTRIBUTED_KINDS:
        for checkpoint in ("never", "always"):
            pipe = DistributedGPipe(model(kind), balance=[3, 3], chunks=4, checkpoint=checkpoint, seed=11)
            assert all(r.replay.fork for r in pipe.runtimes.values())  # auto: a rank owns its generators
            loss = pipe.train_step(*data(), F.mse_loss)
            grads = {}
            for first, part in pipe._chunks.values():
                for name, p in part.named_parameters():
                    i, _, rest = name.partition(".")
                    grads[f"{int(i) + first}.{rest}"] = p.grad.clone()
            out.append((kind, checkpoint, loss.item(), grads))
    return out


@pytest.mark.distributed
def test_distributed_transport_replays_like_the_local_one() -> None:
    """K=2 on two gloo ranks (``auto``: each reseeds its own default generator per micro-batch):
    recompute replays, and the draws equal the local transport's (probe, then the per-op mode)."""
    from gpipe_lab.pipeline.distributed.spawn import run_local

    results = run_local(distributed_worker, 2, timeout=200)
    for r in results:
        assert r.exitcode == 0, r.error
    for i, (kind, checkpoint, _, _) in enumerate(results[0].value):
        net = model(kind)
        pipe = GPipe(net, balance=[3, 3], chunks=4, checkpoint="except_last", seed=11,
                     retain_cpu_memory=False)
        expected_loss = pipe.train_step(*data(), F.mse_loss).item()
        expected = dict(net.named_parameters())
        assert results[1].value[i][2] == pytest.approx(expected_loss, abs=1e-6), (kind, checkpoint)
        grads = {**results[0].value[i][3], **results[1].value[i][3]}
        assert sorted(grads) == sorted(expected)
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name].grad, atol=1e-6, rtol=0, msg=f"{kind} {name}")


def test_random_replay_can_be_turned_off_for_models_that_draw_nothing() -> None:
    """``random_replay=False`` removes the per-op hop: functional draws are then NOT replayed
    (the option is only for models without them), while ``nn.Dropout`` still is."""
    from gpipe_lab.pipeline import PipelineOptions

    def grads(net: nn.Sequential, checkpoint: str) -> list[Tensor]:
        pipe = GPipe(net, options=PipelineOptions(balance=[3, 3], chunks=2, checkpoint=checkpoint, seed=5,
                                                  retain_cpu_memory=False, random_replay=False))
        pipe.train_step(*data(), F.mse_loss)
        return [p.grad.clone() for p in net.parameters()]

    def functional() -> nn.Sequential:
        return model("F.dropout")

    def modules() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, WIDTH), nn.Dropout(0.3), nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3),
                             nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4))

    unreplayed = zip(grads(functional(), "never"), grads(functional(), "always"))
    assert not all(torch.allclose(g, h) for g, h in unreplayed)
    for g, h in zip(grads(modules(), "never"), grads(modules(), "always")):
        torch.testing.assert_close(h, g, atol=1e-6, rtol=0)


class SometimesNoisy(nn.Module):
    """Draws noise only for rows whose first value is positive (a data-dependent draw), and
    records, per call, (recomputing, drew, the replay mode was on)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        from gpipe_lab.pipeline.stage.context import is_recomputing

        draws = bool(x[0, 0] > 0)
        self.calls.append((is_recomputing(), draws, _get_current_dispatch_mode() is not None))
        return x + 0.1 * torch.randn_like(x) if draws else x * 2.0


def test_a_forward_that_drew_nothing_is_replayed_without_the_mode() -> None:
    """With ``random_replay=True``, the per-op replay mode is skipped in the recompute of a
    micro-batch that drew nothing, kept for one that drew; gradients still equal the
    never-checkpointed pipeline's."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2)).abs()
    x[2:4, 0] *= -1  # micro-batch 1 of 4 draws nothing
    x[6:8, 0] *= -1  # nor does micro-batch 3
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))

    def run(checkpoint: str) -> tuple[SometimesNoisy, list[Tensor]]:
        torch.manual_seed(0)
        noisy = SometimesNoisy()
        net = nn.Sequential(noisy, nn.Linear(8, WIDTH), nn.Linear(WIDTH, 4))
        pipe = GPipe(net, balance=[2, 1], chunks=4, checkpoint=checkpoint, seed=7, retain_cpu_memory=False,
                     random_replay=True)  # the per-op mode on every forward (no probe forward)
        pipe.train_step(x, y, F.mse_loss)
        return noisy, [p.grad.clone() for p in net.parameters()]

    _, expected = run("never")
    noisy, grads = run("always")
    for g, h in zip(expected, grads):
        torch.testing.assert_close(h, g, atol=1e-6, rtol=0)
    first = [(drew, mode) for recomputing, drew, mode in noisy.calls if not recomputing]
    replays = [(drew, mode) for recomputing, drew, mode in noisy.calls if recomputing]
    assert first == [(True, True), (False, True), (True, True), (False, True)]  # always under the mode
    assert sorted(replays) == [(False, False), (False, False), (True, True), (True, True)]


def test_only_ops_that_draw_are_counted() -> None:
    """A dropout of probability 0 (the attention kernels of a model without dropout) draws
    nothing, so its forward's replay can skip the mode; a real dropout is counted."""
    x = torch.randn(2, 4, 6, 8)
    with microbatch_context(torch.Generator().manual_seed(0)) as mode:
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.0)
        F.dropout(x, 0.0)
        torch.ops.aten.native_dropout(x, 0.3, False)
    assert mode is not None and mode.draws == 0
    with microbatch_context(torch.Generator().manual_seed(0)) as mode:
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.2)
        F.dropout(x, 0.3)
    assert mode is not None and mode.draws >= 2
    with microbatch_context(torch.Generator().manual_seed(0), replay=False) as mode:
        F.dropout(x, 0.3)
    assert mode is None

"""Long skip connections (``gpipe_lab.pipeline.skip``) against the unpipelined model, to 1e-5.

A U-Net-style model (``gpipe_lab.bench.unet``: encoder blocks stash, decoder blocks pop) is cut
into K = 2 and K = 3 stages (and into virtual stages) and trained for a few steps under every
schedule family and checkpoint mode; loss, outputs, every gradient and the buffers are compared
with the plain ``nn.Sequential`` of the same layers (whose skips wait in the per-thread store).
With dropout the plain layers run each micro-batch with the stage's generator, as the engine
draws; with deferred BatchNorm they run micro-batch by micro-batch, as the stages normalize,
and the running statistics are compared with the same model written the old way (features
carried through every stage as tuples), on the same pipeline.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.bench.unet import Down, Up, carried, unet
from gpipe_lab.pipeline import GPipe, SkipError, pop, skippable, stash
from gpipe_lab.pipeline.stage.context import microbatch_context, microbatch_seed
from gpipe_lab.pipeline.stage.dropout import convert_dropout

pytestmark = pytest.mark.timeout(120)

SEED, STEPS, ROWS, CHUNKS = 7, 2, 12, 3
# (schedule, virtual stages, balance): K = 3, 2 and 1 cuts of the 9 layers; skips cross 0 to 3 stages
CUTS = [("gpipe", 1, [3, 3, 3]), ("1f1b", 1, [2, 4, 3]), ("interleaved-1f1b", 2, [3, 1, 3, 2]),
        ("zb-h1", 1, [3, 3, 3]), ("gpipe-bw", 1, [4, 5]), ("zb-h2", 1, [2, 3, 4]), ("gpipe", 1, [9]),
        ("zb-v", 2, [3, 1, 3, 2])]  # V placement: stages 0 and 3 on rank 0
MODES = ["always", "except_last", "never"]


def batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 8, generator=g)


def plain_steps(model: nn.Sequential, balance: list[int] | None = None) -> list[tuple[Tensor, Tensor, list]]:
    """(loss, outputs, gradients) per SGD step of the unpipelined layers.

    ``balance``: run micro-batch by micro-batch, each stage's layers with that stage's generator
    (the pipeline's draws and per-micro-batch BatchNorm); ``None``: the whole batch at once.
    """
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        sgd.zero_grad()
        if balance is None:
            outputs = model(x)
            loss = F.mse_loss(outputs, y)
            loss.backward()
        else:
            layers, parts, loss = list(model), [], torch.zeros(())
            for mb, (xm, ym) in enumerate(zip(x.chunk(CHUNKS), y.chunk(CHUNKS))):
                h, start = xm, 0
                for j, count in enumerate(balance):
                    g = torch.Generator().manual_seed(microbatch_seed(SEED, step, j, mb))
                    with microbatch_context(g):
                        for layer in layers[start:start + count]:
                            h = layer(h)
                    start += count
                part = F.mse_loss(h, ym) * (len(xm) / len(x))
                part.backward()
                loss, outputs = loss + part.detach(), parts.append(h.detach())
            outputs = torch.cat(parts)
        out.append((loss.detach(), outputs.detach(), [p.grad.clone() for p in model.parameters()]))
        sgd.step()
    return out


def pipe_steps(model: nn.Sequential, schedule: str, v: int, balance: list[int], checkpoint: str,
               **options: Any) -> tuple[list[tuple[Tensor, Tensor, list]], GPipe]:
    pipe = GPipe(model, balance=balance, chunks=CHUNKS, schedule=schedule, virtual_stages=v, checkpoint=checkpoint,
                 seed=SEED, retain_cpu_memory=False, **options)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        sgd.zero_grad()
        loss, outputs = pipe.train_step(*batch(step), F.mse_loss, return_outputs=True)
        out.append((loss.detach(), outputs, [p.grad.clone() for p in model.parameters()]))
        sgd.step()
    return out, pipe


def assert_same(got: list, want: list) -> None:
    for (loss, outputs, grads), (loss_r, outputs_r, grads_r) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outputs, outputs_r, atol=1e-5, rtol=1e-5)
        assert len(grads) == len(grads_r)
        for g, r in zip(grads, grads_r):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule,v,balance", CUTS, ids=[f"{c[0]}-K{len(c[2]) // c[1]}" for c in CUTS])
def test_unet_with_skips_equals_the_unpipelined_sequential(schedule: str, v: int, balance: list[int],
                                                           checkpoint: str) -> None:
    got, pipe = pipe_steps(unet(), schedule, v, balance, checkpoint)
    assert_same(got, plain_steps(unet()))
    # the skips crossed stage boundaries (K=1: every skip stays in the one stage's thread store)
    assert any(s.skips is not None for s in pipe.stages) == (len(balance) > 1)


# every checkpoint mode on fill-drain, one mode on each other family (each case trains three models)
REPLAY = [(*CUTS[0], m) for m in MODES] + [(*CUTS[1], "always"), (*CUTS[2], "except_last"), (*CUTS[3], "always")]


@pytest.mark.parametrize("schedule,v,balance,checkpoint", REPLAY, ids=[f"{c[0]}-{c[3]}" for c in REPLAY])
def test_dropout_replays_and_deferred_batch_norm_with_skips(schedule: str, v: int, balance: list[int],
                                                            checkpoint: str) -> None:
    def build() -> nn.Sequential:
        model = unet(dropout=0.3, batch_norm=True)
        convert_dropout(model)  # the plain layers draw from the context's generator, as the stages do
        return model

    got, _ = pipe_steps(build(), schedule, v, balance, checkpoint, deferred_batch_norm=True)
    assert_same(got, plain_steps(build(), balance))
    # running statistics: as the same layers written without skips commit them on the same pipeline
    with_skips, without = build(), build()
    pipe_steps(with_skips, schedule, v, balance, checkpoint, deferred_batch_norm=True)
    pipe_steps(carried(without), schedule, v, balance, checkpoint, deferred_batch_norm=True)
    buffers = dict(without.named_buffers())
    assert buffers and sorted(buffers) == sorted(dict(with_skips.named_buffers()))
    for name, b in with_skips.named_buffers():
        torch.testing.assert_close(b, buffers[name], atol=1e-5, rtol=1e-5, msg=name)


def test_pipe_call_front_door_with_skips_equals_unpipelined() -> None:
    model, reference = unet(), unet()
    pipe = GPipe(model, balance=[3, 3, 3], chunks=CHUNKS, checkpoint="except_last", seed=SEED,
                 retain_cpu_memory=False)
    x, y = batch(0)
    F.mse_loss(pipe(x), y).backward()
    want = F.mse_loss(reference(x), y)
    want.backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-5, rtol=1e-5)
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), atol=1e-5, rtol=1e-5)


def test_a_skip_goes_straight_to_its_pop_stage_not_through_the_stages_between() -> None:
    """Stage 0 stashes two features that stage 2 pops: stage 1 receives and sends one tensor
    per micro-batch; one message per micro-batch carries both features from stage 0 to stage 2."""
    pipe = GPipe(unet(), balance=[3, 3, 3], chunks=CHUNKS, retain_cpu_memory=False)
    sent: list[tuple[tuple[str, int, int], int, int]] = []
    send = pipe.channel.send

    def recording(key, values, was_tensor, sender):  # type: ignore[no-untyped-def]
        sent.append((key, sender.index, sum(v is not None for v in values)))
        send(key, values, was_tensor, sender)

    pipe.channel.send = recording  # type: ignore[method-assign]
    pipe.train_step(*batch(0), F.mse_loss)
    through_middle = [n for key, src, n in sent if key[1] == 1 or src == 1]
    assert through_middle and set(through_middle) == {1}
    skips = [(key[0], src, key[1], n) for key, src, n in sent if key[0] not in ("F", "B")]
    assert sorted(skips) == sorted([("SB2", 2, 0, 2)] * CHUNKS + [("SF0", 0, 2, 2)] * CHUNKS)


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        stash("a", x * 2)
        return x


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + pop("a")


@skippable(stash=["a"])
class ForgetsToStash(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


@skippable(stash=["a"])
class StashesUndeclared(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        stash("b", x)
        return x


def test_plain_sequential_runs_its_skips_in_one_graph() -> None:
    x = torch.randn(3, 2, requires_grad=True)
    out = nn.Sequential(StashA(), nn.Identity(), PopA())(x)
    torch.testing.assert_close(out, 3 * x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("layers,balance,message", [
    ([nn.Identity(), PopA(), StashA()], [1, 1, 1],
     r"layer 1 \(PopA\) pops skip 'a', but its stash comes later, in layer 2 \(StashA\) \(stage 2, after this "
     r"pop's stage 1\)"),
    ([nn.Identity(), PopA()], [1, 1], r"layer 1 \(PopA\) pops skip 'a', but no layer stashes it"),
    ([StashA(), StashA(), PopA()], [1, 1, 1],
     r"skip 'a' is stashed twice: by layer 0 \(StashA\) and by layer 1 \(StashA\)"),
    ([StashA(), PopA(), PopA()], [1, 1, 1], r"skip 'a' is popped twice: by layer 1 \(PopA\) and by layer 2"),
    ([StashA(), nn.Identity()], [1, 1], r"layer 0 \(StashA\) stashes skip 'a', but no later layer pops it"),
])
def test_bad_skip_declarations_are_refused_at_construction(layers: list, balance: list[int], message: str) -> None:
    with pytest.raises(SkipError, match=message):
        GPipe(nn.Sequential(*layers), balance=balance, chunks=2, retain_cpu_memory=False)


def test_isolated_namespaces_let_one_class_serve_several_skips() -> None:
    model = nn.Sequential(StashA().isolate("x"), StashA().isolate("y"), PopA().isolate("y"), PopA().isolate("x"))
    pipe = GPipe(copy.deepcopy(model), balance=[2, 2], chunks=2, retain_cpu_memory=False)
    x = torch.randn(4, 2)
    torch.testing.assert_close(pipe(x), model(x))
    torch.testing.assert_close(model(x), 5 * x)  # x + 2x (y) + 2x (x)


def test_a_declared_stash_the_forward_skips_is_a_clear_error() -> None:
    pipe = GPipe(nn.Sequential(ForgetsToStash(), PopA()), balance=[1, 1], chunks=2, retain_cpu_memory=False)
    with pytest.raises(SkipError, match=r"stage 0 \(micro-batch 0\) declares the stash of 'a' for stage 1, but "
                                        r"its forward did not stash it"):
        pipe.train_step(torch.randn(4, 2), torch.randn(4, 2), F.mse_loss)


def test_stash_and_pop_check_the_layer_declared_the_name() -> None:
    with pytest.raises(SkipError, match=r"StashesUndeclared calls stash\('b'\) but declares stash=\['a'\]"):
        StashesUndeclared()(torch.randn(2))
    with pytest.raises(SkipError, match=r"stash\('a'\) called outside the forward of a @skippable layer"):
        stash("a", torch.randn(2))
    with pytest.raises(SkipError, match=r"PopA pops 'a', but no earlier layer stashed it in this forward"):
        PopA()(torch.randn(2))


def test_down_and_up_blocks_are_declared_skippable() -> None:
    assert Down.skip_stash == ("feature",) and Up.skip_pop == ("feature",)  # type: ignore[attr-defined]


def test_a_skip_link_whose_two_ends_disagree_on_the_order_is_refused() -> None:
    """Stage 0 runs F1 before F0 while stage 2 consumes micro-batch 0 first: the skip link from
    rank 0 to rank 2 would carry its messages out of the order they are used."""
    from gpipe_lab.pipeline import Action
    from gpipe_lab.pipeline.skip import skip_layout
    from gpipe_lab.pipeline.skip.transport import skip_link_plan

    layout = skip_layout([StashA(), nn.Identity(), PopA()], [1, 1, 1])
    F_, B_ = (lambda s, i: Action(s, "F", i)), (lambda s, i: Action(s, "B", i))
    schedule = [[F_(0, 1), F_(0, 0), B_(0, 0), B_(0, 1)], [F_(1, 0), F_(1, 1), B_(1, 0), B_(1, 1)],
                [F_(2, 0), F_(2, 1), B_(2, 0), B_(2, 1)]]
    with pytest.raises(ValueError, match=r"skip link \('skip0>2', 0, 2\): sent in order"):
        skip_link_plan(schedule, layout, [0, 1, 2])
    in_order = [[F_(0, 0), F_(0, 1), B_(0, 0), B_(0, 1)], *schedule[1:]]
    assert skip_link_plan(in_order, layout, [0, 1, 2]) == {
        ("skip0>2", 0, 2): [("SF0", 2, 0), ("SF0", 2, 1)], ("skipgrad2>0", 2, 0): [("SB2", 0, 0), ("SB2", 0, 1)]}


def test_balance_by_time_profiles_a_model_with_skips() -> None:
    """Each layer is timed forward and backward alone: a popped skip must reach it as a leaf (the
    stash layer's graph is freed by then), as a later stage receives it."""
    from gpipe_lab.pipeline import balance_by_time

    balance = balance_by_time(unet(), torch.randn(4, 8), 3, repeat=1)
    assert sum(balance) == 9 and len(balance) == 3 and min(balance) >= 1


@pytest.mark.slow  # ~12 s on 2 cores: dynamo traces each stage, through the skip frame's thread-local state
def test_compiled_stages_with_skips_equal_the_unpipelined_sequential() -> None:
    model, reference = unet(levels=1), unet(levels=1)
    pipe = GPipe(model, balance=[2, 3], chunks=2, checkpoint="except_last", compile={"backend": "aot_eager"},
                 retain_cpu_memory=False)
    x, y = batch(0)
    loss = pipe.train_step(x, y, F.mse_loss)
    want = F.mse_loss(reference(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-5)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-5, rtol=1e-5)

"""Determinism of the engine on CPU (the rules are written down in docs/reliability.md).

1. Same seed, same K and M: bitwise-identical losses over 20 optimizer steps, also
   with dropout, whatever the checkpoint mode (recompute replays the stage generator).
2. Same seed, different K, M, checkpoint mode or schedule: for a model without
   dropout or BatchNorm, the losses equal the unpipelined model's to 1e-5.
3. Dropout: masks come from generators seeded per (seed, step, stage, micro-batch), so a
   different K or M draws different masks (a different, equally valid, run).
4. Deferred BatchNorm normalizes each micro-batch with its own statistics, so training
   outputs depend on M (M=1 equals plain BatchNorm); the FIRST BatchNorm's running
   statistics equal the full-batch ones for every K and M, later ones do not.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import DeferredBatchNorm

STEPS = 20


def plain_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def dropout_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.2),
                         nn.GELU(), nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 4))


def bn_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                         nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def batches(steps: int = STEPS, size: int = 16):
    g = torch.Generator().manual_seed(42)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)) for _ in range(steps)]


def pipelined_losses(build, partitions: int | None, chunks: int, checkpoint: str = "except_last",
                     schedule: str = "gpipe", seed: int = 5, deferred_batch_norm: bool = False,
                     balance: list[int] | None = None) -> list[float]:
    model = build()
    # one thread per stage: the default follows the machine's load, and the thread count changes
    # the reduction order, so two runs compared bitwise must not leave it to the default
    pipe = GPipe(model, partitions=partitions, balance=balance, chunks=chunks, checkpoint=checkpoint,
                 schedule=schedule, seed=seed, deferred_batch_norm=deferred_batch_norm, threads_per_stage=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for x, y in batches():
        opt.zero_grad()
        out.append(pipe.train_step(x, y, F.mse_loss).item())
        opt.step()
    return out


def unpipelined_losses(build) -> list[float]:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


# ----------------------------------------------------------------------------- rule 1
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_same_seed_same_split_is_bitwise_identical_over_20_steps_in_every_checkpoint_mode(schedule):
    runs = {mode: pipelined_losses(dropout_model, 3, 4, mode, schedule) for mode in ("always", "except_last", "never")}
    again = pipelined_losses(dropout_model, 3, 4, "except_last", schedule)
    assert runs["except_last"] == again  # bitwise: float equality of every step
    assert runs["always"] == runs["never"] == runs["except_last"]
    assert len(set(runs["never"])) == STEPS


# ----------------------------------------------------------------------------- rule 2
@pytest.mark.timeout(120)
@pytest.mark.parametrize("partitions,chunks,checkpoint,schedule", [
    (1, 1, "never", "gpipe"),
    (2, 4, "always", "gpipe"),
    (3, 8, "except_last", "1f1b"),
    (4, 2, "never", "1f1b"),
    (5, 16, "always", "gpipe"),
])
def test_without_dropout_or_batch_norm_every_split_matches_unpipelined_to_1e5(partitions, chunks, checkpoint,
                                                                           schedule):
    reference = unpipelined_losses(plain_model)
    got = pipelined_losses(plain_model, partitions, chunks, checkpoint, schedule)
    assert got == pytest.approx(reference, rel=1e-5, abs=1e-6)


# ----------------------------------------------------------------------------- rule 3
@pytest.mark.timeout(120)
def test_dropout_masks_depend_on_the_split_but_not_on_the_checkpoint_mode():
    base = pipelined_losses(dropout_model, None, 4, "never", balance=[3, 3, 3])
    assert pipelined_losses(dropout_model, None, 4, "always", balance=[3, 3, 3]) == base
    other_m = pipelined_losses(dropout_model, None, 2, "never", balance=[3, 3, 3])
    other_k = pipelined_losses(dropout_model, 2, 4, "never", balance=[5, 4])
    moved = pipelined_losses(dropout_model, None, 4, "never", balance=[1, 3, 5])
    other_seed = pipelined_losses(dropout_model, None, 4, "never", balance=[3, 3, 3], seed=6)
    for other in (other_m, other_k, moved, other_seed):
        assert other[0] != base[0]  # different masks from the first step on
    # the mask depends on the stage that runs the dropout and its draw order there, not on
    # where the other cuts fall: [2, 3, 4] keeps each Dropout in the same stage as [3, 3, 3]
    assert pipelined_losses(dropout_model, None, 4, "never", balance=[2, 3, 4]) == base
    # ... yet each is a valid dropout run: with p -> 0 the runs coincide again (rule 2)
    assert pipelined_losses(lambda: _no_dropout(dropout_model()), None, 2, "never", balance=[2, 3, 4]) == \
        pytest.approx(pipelined_losses(lambda: _no_dropout(dropout_model()), None, 4, "always",
                                       balance=[3, 3, 3]), rel=1e-5, abs=1e-6)


def _no_dropout(model: nn.Sequential) -> nn.Sequential:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.timeout(60)
def test_dropout_mask_seed_rule_is_per_step_stage_and_microbatch():
    """Same (seed, step, stage, micro-batch) -> same mask, whatever thread or run draws it."""
    from gpipe_lab.pipeline.stage.context import microbatch_seed

    seeds = {microbatch_seed(5, step, stage, mb) for step in range(4) for stage in range(4) for mb in range(8)}
    assert len(seeds) == 4 * 4 * 8
    assert microbatch_seed(5, 1, 2, 3) == microbatch_seed(5, 1, 2, 3)
    assert microbatch_seed(5, 1, 2, 3) != microbatch_seed(6, 1, 2, 3)


# ----------------------------------------------------------------------------- rule 4
def _bn_step(chunks: int, balance: list[int]):
    model = bn_model()
    pipe = GPipe(model, balance=balance, chunks=chunks, deferred_batch_norm=True, seed=5)
    x, y = batches(1)[0]
    loss = pipe.train_step(x, y, F.mse_loss)
    bns = [m for m in model.modules() if isinstance(m, DeferredBatchNorm)]
    return loss, bns


@pytest.mark.timeout(60)
def test_deferred_batch_norm_outputs_depend_on_m_and_only_the_first_running_stats_match_full_batch():
    x, y = batches(1)[0]
    reference = bn_model()
    ref_loss = F.mse_loss(reference(x), y)
    ref_bns = [m for m in reference.modules() if isinstance(m, nn.BatchNorm1d)]

    loss_m1, bns_m1 = _bn_step(1, [3, 4])
    assert torch.allclose(loss_m1, ref_loss, atol=1e-6)  # one micro-batch = plain BatchNorm
    for got, want in zip(bns_m1, ref_bns):
        assert torch.allclose(got.running_mean, want.running_mean, atol=1e-6)
        assert torch.allclose(got.running_var, want.running_var, atol=1e-5)

    losses = {}
    for chunks, balance in ((2, [3, 4]), (4, [3, 4]), (4, [2, 2, 3]), (8, [1, 3, 3])):
        loss, bns = _bn_step(chunks, balance)
        losses[chunks] = loss
        assert not torch.allclose(loss, ref_loss, atol=1e-4), f"M={chunks}: micro-batch statistics expected"
        first, second = bns
        assert torch.allclose(first.running_mean, ref_bns[0].running_mean, atol=1e-6)
        assert torch.allclose(first.running_var, ref_bns[0].running_var, atol=1e-5)
        assert int(first.num_batches_tracked) == 1
        assert not torch.allclose(second.running_mean, ref_bns[1].running_mean, atol=1e-4)
    assert not torch.allclose(losses[2], losses[4], atol=1e-4)
    # same M, different K: the same micro-batch statistics, so the same loss
    assert torch.allclose(_bn_step(4, [3, 4])[0], _bn_step(4, [2, 2, 3])[0], atol=1e-6)


@pytest.mark.timeout(120)
def test_deferred_batch_norm_same_split_is_bitwise_identical_over_20_steps():
    a = pipelined_losses(bn_model, None, 4, "always", balance=[3, 4], deferred_batch_norm=True)
    b = pipelined_losses(bn_model, None, 4, "never", balance=[3, 4], deferred_batch_norm=True)
    assert a == b


# ----------------------------------------------------------------------------- data order
def test_synthetic_image_order_depends_only_on_seed_and_epoch():
    """A resumed run builds a fresh loader; it must read epoch e exactly as a loader that
    already ran epochs 0..e-1 (Lightning calls ``set_epoch`` before every epoch)."""
    from gpipe_lab.data import build_datamodule

    def order(loader, epoch):
        loader.sampler.set_epoch(epoch)
        return [y.tolist() for _, y in loader]

    kwargs = dict(batch_size=4, num_train=16, num_val=4, image_size=8, seed=3)
    long_running = build_datamodule("synthetic_images", **kwargs).train_dataloader()
    epochs = [order(long_running, e) for e in range(3)]
    fresh = build_datamodule("synthetic_images", **kwargs).train_dataloader()
    assert order(fresh, 2) == epochs[2]
    assert epochs[0] != epochs[1] != epochs[2]

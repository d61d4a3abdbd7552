"""The V-shaped schedules (zb-v, dualpipev): their placement, their lists, and the engine running
them equal to the unpipelined module (float32, 1e-5), with each stage on the rank the schedule puts it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline.options import OptionError
from gpipe_lab.pipeline.schedules import (
    get_schedule,
    looped_placement,
    placement_of,
    schedule_placement,
    v_placement,
    validate_schedule,
)
from helpers.models import grads, mlp, reference_step

TOL = 1e-5
V_SHAPED = ("zb-v", "dualpipev")


def test_v_placement_puts_rank_r_on_stages_r_and_2k_minus_1_minus_r():
    assert v_placement(3, 2) == (0, 1, 2, 2, 1, 0)
    assert looped_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert schedule_placement("zb-v", 4, 2) == schedule_placement("dualpipev", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule_placement("interleaved-1f1b", 4, 2) == looped_placement(4, 2)


@pytest.mark.parametrize("name", V_SHAPED)
@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
def test_v_lists_are_complete_and_run_on_the_v_placement(name, K):
    for M in range(2 * K if name == "dualpipev" else 1, 4 * K + 2):
        lists = get_schedule(name, K, M, 2)
        validate_schedule(lists, M, 2, v_placement(K, 2))
        assert placement_of(lists, 2 * K) == v_placement(K, 2)
        assert sum(a.kind in "FB" for actions in lists for a in actions) == 2 * 2 * K * M
    if K > 1:  # the same lists are not a looped schedule: the validator names the first misplaced action
        with pytest.raises(ValueError, match=rf"action F0@{2 * K - 1} is on rank 0, but chunk {2 * K - 1} lives on "
                                             rf"rank {K - 1}"):
            validate_schedule(get_schedule(name, K, 2 * K, 2), 2 * K, 2)


def test_zb_v_keeps_at_most_one_f1b1_memory_per_rank():
    """ZB-V's point beside ZB-H2: its peak in flight per rank is 2K chunk-micro-batches, i.e. the
    activation memory of 1F1B's K micro-batches through a whole rank (each chunk is half a rank)."""
    K, M = 4, 16
    for actions in get_schedule("zb-v", K, M, 2):
        live = peak = 0
        for a in actions:
            live += {"F": 1, "W": -1}.get(a.kind, 0) if a.kind != "B" else 0
            peak = max(peak, live)
        assert peak <= 2 * K


@pytest.mark.parametrize("name", V_SHAPED)
@pytest.mark.parametrize(("K", "M", "checkpoint"), [(2, 4, "never"), (2, 5, "except_last"), (3, 6, "always")])
def test_v_schedules_equal_unpipelined(name, K, M, checkpoint):
    torch.manual_seed(1)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    ref_loss, ref_grads = reference_step(mlp(depth=2 * K), x, y, F.mse_loss)
    model = mlp(depth=2 * K)
    pipe = GPipe(model, partitions=K, virtual_stages=2, chunks=M, checkpoint=checkpoint, schedule=name,
                 threads_per_stage=1)
    loss = pipe.train_step(x, y, F.mse_loss)
    torch.testing.assert_close(loss, ref_loss, atol=TOL, rtol=TOL)
    for got, want in zip(grads(model), ref_grads):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    # each event on the rank holding its stage: rank 0 ran the first and the last stage's forwards
    forwards = [e for e in pipe.timeline.events if e.kind == "F"]
    assert {e.stage for e in forwards} == set(range(K))
    assert sum(e.stage == 0 for e in forwards) == 2 * M
    # the layers of stage 2K-1 sit on rank 0's device; the forward-only half keeps the placement
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), mlp(depth=2 * K)(x), atol=TOL, rtol=TOL)


def test_dualpipev_splits_one_micro_batch_on_one_stage_and_not_on_another():
    """dualpipev runs some backwards whole (B alone) and some split (B, later W) for the same
    micro-batch on different stages: the stages must tell them apart by (stage, micro-batch)."""
    lists = get_schedule("dualpipev", 2, 4, 2)
    split = {(a.stage, a.microbatch) for actions in lists for a in actions if a.kind == "W"}
    mixed = {mb for _, mb in split} & {mb for s in range(4) for mb in range(4) if (s, mb) not in split}
    assert mixed  # else this schedule would not exercise the rule
    test_v_schedules_equal_unpipelined("dualpipev", 2, 4, "never")


def test_v_schedules_refuse_what_they_cannot_run():
    with pytest.raises(OptionError, match=r"virtual_stages: schedule 'zb-v' has no form with virtual_stages=1; "
                                          r"it runs with virtual_stages in \[2\]"):
        GPipe(mlp(depth=4), partitions=2, schedule="zb-v")
    with pytest.raises(OptionError, match=r"virtual_stages=3.*in \[2\]"):
        GPipe(mlp(depth=6), partitions=2, virtual_stages=3, schedule="dualpipev")
    pipe = GPipe(mlp(depth=4), partitions=2, virtual_stages=2, chunks=3, schedule="dualpipev")
    with pytest.raises(ValueError, match=r"dualpipev needs at least 2K = 4 micro-batches \(chunks\) with K=2 "
                                         r"ranks, got 3"):
        pipe.train_step(torch.randn(6, 8), torch.randn(6, 8), F.mse_loss)

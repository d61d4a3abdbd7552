"""``register_schedule``: a user's schedule, whole (its one-stage and virtual-stage forms, its
placement), checked when registered and then selectable wherever a built-in one is."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import PipelineOptions, register_schedule, schedule_names
from gpipe_lab.pipeline.schedules import Action, get_schedule, one_f_one_b_schedule, schedule_placement
from helpers.models import grads, mlp, reference_step
from helpers.schedules import registered, v_fill_drain

TOL = 1e-5


def _train(model, **options):
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)), torch.zeros(8, 8)
    pipe = GPipe(model, threads_per_stage=1, **options)
    return pipe.train_step(x, y, F.mse_loss), x, y


def test_a_one_stage_per_rank_schedule_registers_as_before():
    with registered("my-1f1b", one_f_one_b_schedule):
        assert "my-1f1b" in schedule_names()
        assert get_schedule("my-1f1b", 3, 5) == get_schedule("1f1b", 3, 5)
        model = mlp(depth=2)
        loss, x, y = _train(model, partitions=2, chunks=4, schedule="my-1f1b")
        ref_loss, ref_grads = reference_step(mlp(depth=2), x, y, F.mse_loss)
        torch.testing.assert_close(loss, ref_loss, atol=TOL, rtol=TOL)
        for got, want in zip(grads(model), ref_grads):
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    assert "my-1f1b" not in schedule_names()


def test_a_virtual_form_with_its_own_placement_runs_in_gpipe():
    with registered("v-gpipe", virtual_form=v_fill_drain, placement="v", virtual_stages=[2]):
        assert schedule_placement("v-gpipe", 2, 2) == (0, 1, 1, 0)
        PipelineOptions(schedule="v-gpipe", virtual_stages=2).check()
        with pytest.raises(ValueError, match=r"virtual_stages: schedule 'v-gpipe' has no form with "
                                             r"virtual_stages=1; it runs with virtual_stages in \[2\]"):
            PipelineOptions(schedule="v-gpipe").check()
        model = mlp(depth=4)
        loss, x, y = _train(model, partitions=2, virtual_stages=2, chunks=4, schedule="v-gpipe")
        ref_loss, ref_grads = reference_step(mlp(depth=4), x, y, F.mse_loss)
        torch.testing.assert_close(loss, ref_loss, atol=TOL, rtol=TOL)
        for got, want in zip(grads(model), ref_grads):
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def _drop_last_backward(K: int, M: int, v: int) -> list[list[Action]]:
    lists = v_fill_drain(K, M, v)
    lists[0].pop()  # rank 0's last action: B0 of stage 0
    return lists


@pytest.mark.parametrize(("kwargs", "message"), [
    # stage 3 is on rank 0 in the V, on rank 1 when looped: the first misplaced action is named
    (dict(virtual_form=v_fill_drain, placement="looped"),
     r"register_schedule\('bad'\) with K=2, M=4, virtual_stages=2: action F0@3 is on rank 0, but chunk 3 lives "
     r"on rank 1"),
    (dict(virtual_form=_drop_last_backward, placement="v"),
     r"register_schedule\('bad'\) with K=1, M=2, virtual_stages=2: stage 0 has no B for micro-batch 0"),
    (dict(fn=lambda K, M: [[Action(0, "B", 0), Action(0, "F", 0)]] * K),
     r"register_schedule\('bad'\) with K=1, M=2, virtual_stages=1: stage 0: B0 before F0"),
    (dict(fn=lambda K, M: "not lists"), r"must return a list of 1 action lists, got str"),
    (dict(virtual_form=v_fill_drain, placement="zigzag"), r"placement 'zigzag' is not one of \['looped', 'v'\]"),
    (dict(), r"give fn \(one stage per rank\), virtual_form, or both"),
])
def test_a_bad_schedule_is_refused_at_registration_naming_the_first_bad_action(kwargs, message):
    with pytest.raises(ValueError, match=message):
        register_schedule("bad", **kwargs)
    assert "bad" not in schedule_names()  # nothing half-registered

"""Pieces of the distributed transport that need no processes: headers, link plans, world checks."""

from __future__ import annotations

import pytest
import torch

from gpipe_lab.pipeline.distributed.links import message_plan
from gpipe_lab.pipeline.distributed.topology import check_world
from gpipe_lab.pipeline.distributed.wire import HEADER_SLOTS, decode_header, encode_header
from gpipe_lab.pipeline.schedules import interleaved_1f1b_schedule, validate_rank_schedule


def test_header_round_trip_with_none_and_long_shapes() -> None:
    values = (torch.zeros(3, 5), None, torch.zeros(2, dtype=torch.bool),
              torch.zeros(*([1] * 12), dtype=torch.int64).requires_grad_(False))
    words = encode_header(values, False)
    assert len(words) > HEADER_SLOTS  # needs the continuation message
    specs, was_tensor = decode_header(words)
    assert not was_tensor
    assert specs == [(torch.float32, (3, 5), False), None, (torch.bool, (2,), False),
                     (torch.int64, (1,) * 12, False)]


def test_world_size_must_be_divisible_by_stages() -> None:
    with pytest.raises(ValueError, match="world size 6 is not divisible .* 4"):
        check_world(6, 4)


@pytest.mark.parametrize("K,M,v", [(2, 4, 2), (4, 8, 2), (3, 6, 3), (2, 2, 4)])
def test_interleaved_schedule_is_valid_and_links_stay_in_order(K: int, M: int, v: int) -> None:
    ranks = interleaved_1f1b_schedule(K, M, v)
    validate_rank_schedule(ranks, M, v)
    plan = message_plan(ranks, list(range(K)), K * v)
    assert sum(len(m) for m in plan.values()) == 2 * M * (K * v - 1)  # every chunk boundary crosses ranks
    total = M * v
    warmup = total if M == K else min(total, 2 * (K - 1) + (v - 1) * K)
    first_backward = next(i for i, a in enumerate(ranks[0]) if a.kind == "B")
    assert first_backward == (warmup if warmup == total else warmup + 1)

"""The simulator and ``plan=auto``'s search take each stage's rank from the schedule: the V-shaped
schedules and a registered schedule with a placement of its own."""

from __future__ import annotations

import pytest

from gpipe_lab.pipeline.schedules import get_schedule
from gpipe_lab.planner import StageCosts, predict_step
from gpipe_lab.planner.profile_cache import load_or_measure
from gpipe_lab.planner.search import candidates, plan_auto
from gpipe_lab.planner.simulator import simulate_stages, unit_cost_bubble
from helpers.fake_timing import use_fake_timing
from helpers.schedules import registered, v_fill_drain

TINY = {"num_layers": 4, "d_model": 32, "ffn_dim": 64, "num_heads": 2, "vocab_size": 64, "seq_len": 8}


@pytest.mark.parametrize(("K", "M"), [(2, 4), (4, 8), (8, 16)])
def test_unit_cost_bubbles_match_the_closed_forms(K, M):
    """At F = B = W: 1F1B (K-1)/(M+K-1), ZB-H1 (K-1)/(3M+K-1); zb-v and dualpipev (two half-size
    chunks per rank, each F = B = W = 1/2) (K-1)/(6M+K-1), as the README's table says."""
    assert unit_cost_bubble("1f1b", K, M) == pytest.approx((K - 1) / (M + K - 1))
    assert unit_cost_bubble("zb-h1", K, M) == pytest.approx((K - 1) / (3 * M + K - 1))
    for name in ("zb-v", "dualpipev"):
        assert unit_cost_bubble(name, K, M, 2) == pytest.approx((K - 1) / (6 * M + K - 1))


def test_a_hand_over_between_two_stages_of_one_rank_costs_no_transfer():
    """zb-v's turn (stage K-1 to K) stays on rank K-1; every other hop crosses ranks."""
    K, M = 2, 4
    stages = simulate_stages(get_schedule("zb-v", K, M, 2), StageCosts.uniform(2 * K, 1.0, 1.0, 1.0, transfer=5.0))
    span = {(e.stage, e.kind, e.microbatch): (e.start, e.end) for e in stages.events}
    assert span[(2, "F", 0)][0] == span[(1, "F", 0)][1]  # stages 1 and 2: both on rank 1
    assert span[(1, "F", 0)][0] >= span[(0, "F", 0)][1] + 5.0  # stages 0 and 1: ranks 0 and 1


def test_by_rank_timeline_follows_the_placement():
    K, M = 2, 4
    timeline = predict_step(get_schedule("zb-v", K, M, 2), StageCosts.uniform(2 * K)).timeline
    assert timeline.num_stages == K
    forwards = [(e.stage, e.microbatch) for e in timeline.events if e.kind == "F"]
    assert sorted(forwards) == sorted((r, mb) for r in range(K) for mb in range(M) for _ in range(2))


@pytest.fixture
def profile(monkeypatch, tmp_path):
    use_fake_timing(monkeypatch, tmp_path)
    return load_or_measure("transformer_tiny", TINY, 16, [16, 8, 4, 2, 1])[0]


def test_the_search_plans_v_shaped_and_registered_schedules_with_their_virtual_stages(profile):
    with registered("v-gpipe", virtual_form=v_fill_drain, placement="v", virtual_stages=[2]):
        every = candidates(profile, devices=2, schedules=["zb-v", "dualpipev", "v-gpipe", "1f1b"])
        by_name = {}
        for s in every:
            by_name.setdefault(s.candidate.options.schedule, []).append(s.candidate.options)
        for name in ("zb-v", "dualpipev", "v-gpipe"):  # only v = 2, on 2 devices (4 stages of the 4 layers)
            assert {(o.partitions, o.virtual_stages, len(o.balance)) for o in by_name[name]} == {(2, 2, 4)}
        assert all(o.chunks >= 4 for o in by_name["dualpipev"])  # M >= 2K: the others are refused
        best = plan_auto(profile, 2**40, devices=2, schedules=["v-gpipe"])
        assert best.chosen.candidate.options.schedule == "v-gpipe" and best.chosen.step_time is not None
    with pytest.raises(ValueError, match=r"schedules: \['v-gpipe'\] must be a non-empty list of"):
        candidates(profile, devices=2, schedules=["v-gpipe"])

"""The automatic planner: budgets respected, impossible budgets refused with the smallest that fits,
the profile measured once, the stage memory model against the engine, memory strings, the CLI."""

from __future__ import annotations

import pytest

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.schedules import get_schedule
from gpipe_lab.planner.cli import main
from gpipe_lab.planner.memory import StageMemoryModel, format_bytes, layer_records, parse_memory
from gpipe_lab.planner.plan_types import CHECKPOINTS, VIRTUAL_STAGES, NoPlanFits
from gpipe_lab.planner.profile_cache import fixed_bytes, load_or_measure
from gpipe_lab.planner.search import candidates, plan_auto, plan_model
from gpipe_lab.planner.trials import per_device
from gpipe_lab.planner.workload import WorkloadSpec
from helpers.fake_timing import use_fake_timing

TINY = {"num_layers": 4, "d_model": 32, "ffn_dim": 64, "num_heads": 2, "vocab_size": 64, "seq_len": 8}
SETS = [f"--set={k}={v}" for k, v in TINY.items()]


@pytest.fixture
def profile(monkeypatch, tmp_path):
    use_fake_timing(monkeypatch, tmp_path)
    return load_or_measure("transformer_tiny", TINY, 16, [16, 8, 4, 2, 1])[0]


def smallest_fit(profile) -> float:
    with pytest.raises(NoPlanFits) as refused:
        plan_auto(profile, 1, devices=2)
    return refused.value.smallest.peak_bytes


def test_every_stage_of_the_chosen_plan_fits_and_a_tighter_budget_changes_it(profile):
    loose = plan_auto(profile, 2**30, devices=2)
    least = smallest_fit(profile)
    assert least < loose.chosen.peak_bytes  # the loose plan spends memory for speed
    tight_budget = (least + loose.chosen.peak_bytes) / 2
    tight = plan_auto(profile, tight_budget, devices=2)
    for result, budget in ((loose, 2**30), (tight, tight_budget)):
        assert all(b <= budget for b in result.chosen.stage_bytes)
        assert result.chosen.candidate.options.partitions <= 2
    assert tight.chosen.candidate != loose.chosen.candidate
    assert tight.chosen.step_time >= loose.chosen.step_time  # the loose search could have chosen it
    # the runner-ups say why they lost, computed from their own figures
    for r in tight.runners_up:
        if r.step_time is None:
            assert r.reason.startswith("over memory on stage") and r.peak_bytes > tight_budget
        else:
            assert r.step_time >= tight.chosen.step_time * (1 - 1e-3)
            assert r.reason == f"slower by {r.step_time / tight.chosen.step_time - 1:.1%}" or (
                r.reason.startswith("as fast") and r.peak_bytes > tight.chosen.peak_bytes)


def test_an_impossible_budget_names_the_smallest_memory_that_fits_and_its_plan(profile):
    with pytest.raises(NoPlanFits) as refused:
        plan_auto(profile, 1000, devices=2)
    least = refused.value.smallest
    message = str(refused.value)
    assert "\n" not in message and f"{int(least.peak_bytes)} bytes" in message
    assert least.candidate.describe() in message
    at_least = plan_auto(profile, least.peak_bytes, devices=2)  # that memory does fit
    assert at_least.chosen.peak_bytes <= least.peak_bytes


def test_the_profile_is_measured_once_and_then_read_from_the_cache(monkeypatch, tmp_path):
    calls = use_fake_timing(monkeypatch, tmp_path)
    first, cached = load_or_measure("transformer_tiny", TINY, 16, [16, 4])
    timed = len(calls)
    assert not cached and timed == 4  # two sizes, alone and beside a second stage
    second, cached = load_or_measure("transformer_tiny", TINY, 16, [16, 4])
    assert cached and len(calls) == timed  # nothing timed again
    assert second.alone == first.alone and second.memory == first.memory
    load_or_measure("transformer_tiny", {**TINY, "d_model": 16}, 16, [16, 4])  # another model: measured
    assert len(calls) == 2 * timed


@pytest.mark.parametrize(("schedule", "checkpoint", "virtual"), [
    ("gpipe", "except_last", 1), ("1f1b", "never", 1), ("zb-h1", "always", 1), ("interleaved-1f1b", "except_last", 2)])
def test_the_stage_memory_model_bounds_what_the_engine_tracks(schedule, checkpoint, virtual):
    work = WorkloadSpec("t", "transformer_tiny", TINY, 16)
    model = StageMemoryModel(layer_records("transformer_tiny", **TINY), 4.0, fixed_bytes(work))
    built = work.build(2 * virtual)
    pipe = GPipe(built.module, balance=built.balance, chunks=4, checkpoint=checkpoint, schedule=schedule,
                 virtual_stages=virtual, threads_per_stage=1, seed=0)
    pipe.train_step(built.inputs, built.targets, built.loss_fn)
    measured = per_device(pipe.memory(), 2, bytes_per_param=4.0)  # a device's virtual stages summed
    predicted = model.stage_peaks(get_schedule(schedule, 2, 4, virtual), built.balance, 4, 16, checkpoint)
    assert len(predicted) == len(measured) == 2
    for p, m in zip(predicted, measured):
        assert m <= p <= 1.1 * m


def test_interleaved_plans_are_searched_with_virtual_stages_and_described(profile):
    every = candidates(profile, devices=2)
    interleaved = [s.candidate.options for s in every if s.candidate.options.schedule == "interleaved-1f1b"]
    assert {c.virtual_stages for c in interleaved} == set(VIRTUAL_STAGES) - {v for v in VIRTUAL_STAGES
                                                                              if 2 * v > profile.num_layers}
    assert all(c.partitions == 2 and len(c.balance) == 2 * c.virtual_stages for c in interleaved)
    c = next(s.candidate for s in every if s.candidate.options == interleaved[0])
    assert f"schedule=interleaved-1f1b virtual_stages={c.options.virtual_stages} " in c.describe()
    only = candidates(profile, devices=2, schedules=["interleaved-1f1b"])  # without 1f1b: v=1 is searched too
    assert {s.candidate.options.virtual_stages for s in only if s.candidate.options.partitions == 1} == {1}
    best = plan_auto(profile, 2**40, devices=2, schedules=["interleaved-1f1b"])
    assert best.chosen.step_time is not None and best.chosen.candidate.options.schedule == "interleaved-1f1b"


@pytest.mark.parametrize(("text", "expected"), [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1.5e9),
                                                ("4096", 4096), (2048, 2048), ("2 kib", 2048)])
def test_memory_strings(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["8 gigs", "GiB", "-1GiB", "0", True, "8GiB8"])
def test_bad_memory_strings_give_one_line_naming_the_value_and_the_forms(bad):
    with pytest.raises(ValueError) as error:
        parse_memory(bad, "pipeline.memory_per_device")
    message = str(error.value)
    assert "\n" not in message and message.startswith("pipeline.memory_per_device:") and repr(bad) in message
    assert "GiB" in message and "GB" in message
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"


def test_cli_prints_the_chosen_plan_and_the_runner_ups(monkeypatch, tmp_path, capsys):
    use_fake_timing(monkeypatch, tmp_path)
    args = ["auto", "--model", "transformer_tiny", *SETS, "--batch", "16", "--devices", "2"]
    assert main([*args, "--memory", "4MiB", "--trials", "0"]) == 0
    out = capsys.readouterr().out
    assert "chosen: K=" in out and "predicted step" in out and "runner-ups:" in out
    assert "slower by" in out or "over memory on stage" in out
    result, _, facts = plan_model("transformer_tiny", TINY, 16, 4 * 2**20, 2, trials=0)
    assert facts["cached"] and result.chosen.candidate.describe() in out  # the CLI's plan, from the cache
    assert main([*args, "--memory", "4MiB"]) == 0  # three trials by default
    out = capsys.readouterr().out
    assert "3 plans trialled in" in out and "(fastest measured of 3 trials)" in out
    assert out.count("in trial") == 3  # the chosen plan and two runner-ups show their measured step
    assert main([*args, "--memory", "4MiB", "--trials", "-1"]) == 2
    assert "trials: must be >= 0" in capsys.readouterr().err
    assert main([*args, "--memory", "1KiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "smallest memory that fits is" in err
    assert main([*args, "--memory", "lots"]) == 2
    assert "'lots' is not a memory size" in capsys.readouterr().err
    assert main([*args, "--memory", "4MiB", "--checkpoints", "sometimes"]) == 2
    assert str(list(CHECKPOINTS)) in capsys.readouterr().err


def test_a_schedule_that_cannot_run_an_m_is_left_out_of_the_search(profile, monkeypatch):
    from gpipe_lab.pipeline.schedules import get_schedule
    from gpipe_lab.planner import search

    with pytest.raises(ValueError, match="cannot run M=32"):
        get_schedule("interleaved-1f1b", 5, 32, 2)  # deadlocks: M must be a multiple of 5 here

    def refusing(name, k, m, v=1):
        if (name, k, m, v) == ("interleaved-1f1b", 2, 4, 2):
            raise ValueError("interleaved 1F1B with K=2, v=2 cannot run M=4 micro-batches")
        return get_schedule(name, k, m, v)

    monkeypatch.setattr(search, "get_schedule", refusing)
    every = [s.candidate.options for s in candidates(profile, devices=2, schedules=["interleaved-1f1b"])]
    assert not any((c.partitions, c.chunks, c.virtual_stages) == (2, 4, 2) for c in every)
    assert any((c.partitions, c.chunks, c.virtual_stages) == (2, 8, 2) for c in every)


def test_the_bound_never_exceeds_a_prediction_and_the_search_finds_the_brute_force_best(profile):
    from gpipe_lab.planner.rank import TIE

    cost, split = profile.cost_model(), profile.split_backward
    every = candidates(profile, devices=3)
    for s in every:
        full = cost.predict_options(s.candidate.options, profile.batch, split).step_time
        assert cost.lower_bound(s.candidate.options, profile.batch, split) <= full * (1 + 1e-9), s.candidate.describe()
        s.step_time = full
    best = min(s.step_time for s in every)
    chosen = plan_auto(profile, 2**40, devices=3).chosen
    assert chosen.step_time <= best * (1 + TIE)

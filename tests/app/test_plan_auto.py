"""``gpipe-train pipeline.plan=auto``: the run plans first, trains the chosen plan and records the
prediction beside the measured figures; bad planner keys and impossible budgets are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpipe_lab.app.config.groups import ConfigError, validate
from helpers.app import SMALL, cli_here, make_config
from helpers.fake_timing import use_fake_timing


def test_plan_auto_runs_the_chosen_plan_and_records_predicted_beside_measured(tmp_path: Path, capsys,
                                                                               monkeypatch) -> None:
    calls = use_fake_timing(monkeypatch, tmp_path)  # the search is what is tested here, not the timing
    run = cli_here(tmp_path, capsys, monkeypatch)
    args = [*SMALL, "trainer.max_steps=2", "pipeline.plan=auto", "pipeline.memory_per_device=2MiB",
            "pipeline.devices_available=2"]
    done = run(*args)
    assert done.code == 0, done.out[-2000:] + done.err[-2000:]
    assert "chosen: K=" in done.out and "runner-ups:" in done.out
    summary = json.loads(next(tmp_path.glob("train/runs/*/summary.json")).read_text())
    chosen = summary["plan_chosen"]
    v = f" virtual_stages={summary['virtual_stages']}" if summary["virtual_stages"] > 1 else ""
    assert chosen == (f"K={summary['K']} M={summary['M']} balance={summary['balance']} "
                      f"schedule={summary['schedule']}{v} checkpoint={summary['checkpoint']}")  # what ran
    for key in ("step_s", "bubble", "peak_bytes"):
        assert summary[f"predicted_{key}"] is not None and summary[f"measured_{key}"] is not None
    assert len(summary["predicted_stage_peak_bytes"]) == len(summary["measured_stage_peak_bytes"]) == summary["K"]
    assert summary["predicted_peak_bytes"] <= summary["plan_memory_per_device_bytes"] == 2 * 2**20
    assert summary["measured_within_budget"] == (summary["measured_peak_bytes"] <= 2 * 2**20)
    assert summary["measured_within_budget"]
    assert summary["plan_trials"] == 3 and summary["plan_trial_step_s"] > 0  # chosen by measurement
    assert "3 plans trialled" in done.out
    timed = len(calls)
    done = run(*args[:-2], "pipeline.memory_per_device=1KiB")  # the cached profile; nothing fits
    assert len(calls) == timed
    assert done.code != 0 and "no plan fits 1.0 KiB per device" in str(done.code)
    assert "smallest memory that fits is" in str(done.code) and "\n" not in str(done.code)


@pytest.mark.parametrize(("override", "message"), [
    ("pipeline.memory_per_device='8 gigs'", r"pipeline\.memory_per_device: '8 gigs' is not a memory size; "
                                            r"allowed: .*8GiB, 512MiB, 1\.5GB"),
    ("pipeline.plan=smart", r"pipeline\.plan: must be one of \['manual', 'auto'\], got 'smart'"),
    ("pipeline.devices_available=0", r"pipeline\.devices_available: must be an integer >= 1"),
    ("pipeline.schedules_allowed=[gpipe,fast]", r"pipeline\.schedules_allowed: must be null or a non-empty list"),
    ("pipeline.plan_trials=-2", r"pipeline\.plan_trials: must be an integer >= 0 .*got -2"),
    ("pipeline.plan_trials=many", r"pipeline\.plan_trials: must be an integer >= 0 .*got 'many'"),
])
def test_bad_planner_keys_are_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        validate(make_config("pipeline.plan=auto", "pipeline.memory_per_device=8GiB", override))
    assert "\n" not in str(error.value)


def test_plan_auto_needs_a_budget() -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.memory_per_device: pipeline\.plan=auto needs a memory budget"):
        validate(make_config("pipeline.plan=auto"))
    assert validate(make_config("pipeline.memory_per_device=1GiB")).options.partitions == 2  # manual: the options as given

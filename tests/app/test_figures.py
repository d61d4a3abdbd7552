"""Figures that mean what they say: each schedule's own theoretical bubble, first and last step
always in the history, and one naming scheme shared by summary.json and the history."""

from __future__ import annotations

import csv

import pytest

from gpipe_lab.app.train import run
from gpipe_lab.lightning.callbacks import ALIASES, theory_bubble
from gpipe_lab.pipeline import analytic_bubble
from helpers.app import make_config

SMALL = ["trainer=smoke", "logger=csv", "data.num_train=64", "data.num_val=8", "data.batch_size=8",
         "model.num_filters=8", "data.image_size=8", "model.image_size=8"]


def test_theory_bubble_is_the_schedules_own():
    assert theory_bubble("gpipe", 4, 8) == pytest.approx(analytic_bubble(4, 8))  # fill-drain
    assert theory_bubble("zb-h1", 4, 8) < 0.5 * analytic_bubble(4, 8)  # zero-bubble fills the drain
    # two stages per rank: the schedule's own form and placement (zb-v has no one-stage form)
    assert theory_bubble("zb-v", 4, 8, 2) == pytest.approx(3 / (6 * 8 + 3))
    assert theory_bubble("interleaved-1f1b", 4, 8, 2) == pytest.approx(analytic_bubble(4, 8, 2))


def test_a_run_shorter_than_log_every_n_steps_logs_first_and_last_step_and_names_figures_once(tmp_path):
    summary = run(make_config(*SMALL, "trainer.max_steps=3", "trainer.log_every_n_steps=50",
                              "pipeline.schedule=zb-h1", tmp_path=tmp_path))
    rows = list(csv.DictReader(open(next(tmp_path.glob("run/csv/version_*/metrics.csv")))))
    logged = {int(r["step"]): r for r in rows if r.get("perf/samples_per_s")}
    assert sorted(logged) == [0, 2]
    assert all(logged[s]["train/loss"] and logged[s]["pipeline/bubble_measured"] for s in logged)
    assert float(logged[2]["pipeline/bubble_theory"]) == pytest.approx(theory_bubble("zb-h1", 2, 4))

    for flat, named in ALIASES.items():
        assert named in summary and summary[named] == summary[flat]
    assert summary["pipeline/bubble_theory"] == pytest.approx(theory_bubble("zb-h1", 2, 4))
    assert summary["bubble_measured_over"].startswith("mean over 2 step(s)")
    assert (summary["optimizer"], summary["D"], summary["run_dir"]) == ("adam", 1, "run")
    assert summary["run_name"].startswith("K2-M4-zb-h1")  # the wandb run's name
    assert summary["lr"] > 0


def test_timeline_pictures_can_be_switched_off_and_the_figures_stay(tmp_path):
    """``callbacks.timeline_pictures=false`` (a sweep of short jobs): no picture, the same history."""
    summary = run(make_config(*SMALL, "trainer.max_steps=2", "callbacks.timeline_pictures=false", tmp_path=tmp_path))
    assert summary["steps"] == 2 and 0 <= summary["bubble_measured"] < 1
    assert not list(tmp_path.rglob("timeline_*.png"))
    drawn = tmp_path / "drawn"
    run(make_config(*SMALL, "trainer.max_steps=2", "callbacks.timeline_pictures=true", tmp_path=drawn))
    assert sorted(p.name for p in drawn.rglob("timeline_*.png")) == ["timeline_first.png", "timeline_last.png"]

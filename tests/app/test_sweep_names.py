"""A sweep over any key says what each job varied: its wandb run's name and a column of
``sweep_summary.md`` per swept key (issue 46: ``-m optimizer.lr=0.001,0.01`` gave two identical rows)."""

from __future__ import annotations

import json

import pytest

from gpipe_lab.app.sweep_check import job_sweep_values
from gpipe_lab.app.wandb_reader import find_run_files, read_run
from gpipe_lab.app.wandb_run import run_name
from gpipe_lab.pipeline.options import PipelineOptions
from helpers.app import SMALL, cli_here, make_config


def test_the_name_adds_the_swept_keys_it_does_not_show_yet() -> None:
    options = PipelineOptions(partitions=2, chunks=4)
    swept = {"pipeline.partitions": "2", "optimizer.lr": "0.01", "data": "synthetic_images"}
    assert run_name(options, swept) == "K2-M4-gpipe-optimizer.lr=0.01-data=synthetic_images"
    assert run_name(options, {"pipeline.chunks": "4"}) == run_name(options) == "K2-M4-gpipe"


def test_a_single_run_varies_nothing() -> None:
    make_config("optimizer.lr=0.01")  # a single run's Hydra config: nothing is swept
    assert job_sweep_values() == {}


@pytest.mark.slow  # two wandb-logged sweep jobs: 18 s on 2 shared cores
def test_a_sweep_over_the_learning_rate_names_its_runs_and_columns_by_it(tmp_path, capsys, monkeypatch) -> None:
    gpipe_train = cli_here(tmp_path, capsys, monkeypatch)
    small = [o for o in SMALL if o != "logger=none"]
    done = gpipe_train("-m", "optimizer.lr=0.001,0.01", *small, "trainer.max_steps=1", "logger=wandb")
    assert done.code in (0, None), done.err[-3000:]
    (sweep,) = tmp_path.glob("train/multiruns/*")
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["run_name"] for r in rows] == ["K2-M4-gpipe-optimizer.lr=0.001", "K2-M4-gpipe-optimizer.lr=0.01"]
    assert [r["swept"] for r in rows] == [{"optimizer.lr": "0.001"}, {"optimizer.lr": "0.01"}]
    table = (sweep / "sweep_summary.md").read_text().splitlines()
    header = [c.strip() for c in table[2].strip("|").split("|")]
    assert header[:3] == ["job", "run", "optimizer.lr"], header
    assert [line.split("|")[3].strip() for line in table[4:6]] == ["0.001", "0.01"], table
    names = sorted(read_run(f).name for job in ("0", "1") for f in find_run_files(sweep / job))
    assert names == ["K2-M4-gpipe-optimizer.lr=0.001", "K2-M4-gpipe-optimizer.lr=0.01"], names

"""Two runs (or two sweeps) started within one second get two folders: ``gpipe_lab.app.run_dir``.

The clock Hydra's ``${now:...}`` reads is pinned (``hydra.core.utils.datetime``), so both commands
compose the same ``logs/<task>/runs/<time>``: without the claim the second run would write its
``.hydra`` config, checkpoints and summary into the first one's folder.
"""

from __future__ import annotations

from datetime import datetime

import hydra.core.utils
import pytest
import yaml

from gpipe_lab.app.run_dir import claim_dir
from helpers.app import SMALL, cli_here

STAMP = "2026-01-02_03-04-05"


class PinnedClock(datetime):
    """A ``datetime`` whose ``now()`` is one fixed second."""

    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        return cls(2026, 1, 2, 3, 4, 5, tzinfo=tz)


def test_claim_dir_creates_the_folder_or_the_first_free_suffix(tmp_path):
    wanted = tmp_path / "runs" / STAMP
    claimed = [claim_dir(wanted) for _ in range(3)]
    assert claimed == [wanted, tmp_path / "runs" / f"{STAMP}_1", tmp_path / "runs" / f"{STAMP}_2"]
    assert all(p.is_dir() for p in claimed)


def overrides_of(run) -> list[str]:
    return yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())


@pytest.mark.timeout(240)
def test_two_runs_in_one_second_get_two_folders(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hydra.core.utils, "datetime", PinnedClock)
    run = cli_here(tmp_path, capsys, monkeypatch)
    for seed in (1, 2):
        done = run(*SMALL, "trainer.max_steps=1", f"seed={seed}")
        assert done.code in (0, None), done.err[-3000:]
    runs = sorted((tmp_path / "train" / "runs").iterdir())
    assert [p.name for p in runs] == [STAMP, f"{STAMP}_1"]
    for run_dir, seed in zip(runs, (1, 2)):
        assert f"seed={seed}" in overrides_of(run_dir), run_dir  # each folder holds its own run's config
        assert (run_dir / "summary.json").is_file() and (run_dir / "train.log").is_file()


@pytest.mark.timeout(240)
def test_two_sweeps_in_one_second_get_two_folders(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hydra.core.utils, "datetime", PinnedClock)
    run = cli_here(tmp_path, capsys, monkeypatch)
    for seed in (1, 2):
        done = run("-m", *SMALL, "trainer.max_steps=1", f"seed={seed}")
        assert done.code in (0, None), done.err[-3000:]
    sweeps = sorted((tmp_path / "train" / "multiruns").iterdir())
    assert [p.name for p in sweeps] == [STAMP, f"{STAMP}_1"]
    for sweep, seed in zip(sweeps, (1, 2)):
        assert f"seed={seed}" in overrides_of(sweep / "0"), sweep  # the job ran in its own sweep's folder
        assert (sweep / "0" / "summary.json").is_file() and (sweep / "sweep_summary.md").is_file()

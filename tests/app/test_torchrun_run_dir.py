"""A torchrun launch of ``gpipe-train`` is one run: one run folder, one wandb run (issue 46).

The ranks are started as torchrun starts them (each forked, joining the store this test process
hosts: ``helpers.forked.run_torchrun``); rank 0 names the folder Hydra made for it, the other rank
writes into it (its own log file, no ``.hydra`` copy).
"""

from __future__ import annotations

import json

import pytest

from helpers.app import SMALL, gpipe_train


@pytest.mark.slow  # two ranks' start-up and a wandb run: about 20 s on two busy cores
@pytest.mark.timeout(420)
def test_a_torchrun_launch_makes_one_run_folder_and_one_wandb_run(tmp_path):
    small = [o for o in SMALL if o != "logger=none"]
    done = gpipe_train(["pipeline.transport=distributed", "trainer=distributed", "logger=wandb", *small,
                 "trainer.max_steps=1"], tmp_path, timeout=360, torchrun=2)
    runs = sorted((tmp_path / "train" / "runs").iterdir())
    assert len(runs) == 1, runs
    run = runs[0]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "train.log").is_file()
    assert (run / "train_ddp_process_1.log").is_file()  # rank 1's log, beside rank 0's
    assert json.loads((run / "summary.json").read_text())["transport"] == "distributed"
    wandb_runs = list(tmp_path.rglob("offline-run-*"))
    assert [p.parent for p in wandb_runs] == [run / "wandb"], wandb_runs
    assert done.stdout.count("config: ") == 1  # the composed config: rank 0 saved and names it

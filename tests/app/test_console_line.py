"""What a finished ``gpipe-train`` run prints, captured as a user sees it (no ``WANDB_SILENT``):
one line of ours naming what ran, where and its timeline pictures, and no wandb history and
summary block nor Lightning's ``limit_val_batches=1.0`` echo (issue 46)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.app import SMALL, cli_here


def test_a_smoke_run_ends_in_one_line_naming_its_summary_pictures_and_wandb_run(tmp_path: Path, capfd,
                                                                                monkeypatch) -> None:
    gpipe_train = cli_here(tmp_path, capfd, monkeypatch)  # capfd: wandb's own processes' output too
    monkeypatch.delenv("WANDB_SILENT")
    monkeypatch.delenv("WANDB_QUIET", raising=False)
    done = gpipe_train(*(o for o in SMALL if o != "logger=none"), "logger=wandb", "trainer.max_steps=2",
                       "trainer.limit_val_batches=1.0", "callbacks.timeline_pictures=true")
    console = done.out + done.err
    assert done.code in (0, None), console[-3000:]
    assert not [line for line in console.splitlines() if line.startswith("wandb:")], console
    assert "limit_val_batches" not in console, console
    (run_dir,) = tmp_path.glob("train/runs/*")
    last = done.out.strip().splitlines()[-1]
    match = re.fullmatch(r"summary: K=2 M=4 train_loss=\S+ val/acc=\S+ test/acc=\S+ samples/s=\S+ run=K2-M4-gpipe "
                         r"-> (\S+); timelines (\S+) (\S+); wandb (\S+)", last)
    assert match, last
    assert [Path(p) for p in match.groups()] == [
        run_dir / "summary.json", run_dir / "timeline_first.png", run_dir / "timeline_last.png",
        next((run_dir / "wandb").glob("offline-run-*"))]
    assert all(Path(p).exists() for p in match.groups())
    assert sum(line.startswith("summary:") for line in console.splitlines()) == 1

"""A user's second day (issue 31), the rest: what a run tells its user, and its disk and history.

Driven through ``gpipe-train``'s console entry point in this process, with the user's ``sys.argv``:
the progress bar's last line and the summary agree, a mid-epoch resume keeps a bar with a total,
a resumed wandb run leaves one value per step, and a run that fails while training leaves a
folder only when it holds something to keep.
"""

from __future__ import annotations

import io
import json
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpipe_lab.app.train import cli
from gpipe_lab.app.wandb_reader import branch_point, find_run_files, read_run, synced_history
from gpipe_lab.app.wandb_reader import main as reader_main
from helpers.app import SMALL


@dataclass
class Done:
    """What ``gpipe-train`` left: its exit status (or message) and what it printed."""

    code: int | str | None
    out: str
    err: str


def gpipe_train(tmp_path: Path, *args: str) -> Done:
    """``gpipe-train ARGS`` in this process, in ``tmp_path`` (the console script's ``cli``, the user's
    ``sys.argv``): the same command line without paying a new process's imports."""
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err):
        mp.chdir(tmp_path)
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.delenv("HYDRA_FULL_ERROR", raising=False)
        mp.setattr(sys, "argv", ["gpipe-train", *args, f"paths.log_dir={tmp_path}"])
        try:
            cli()
        except SystemExit as exc:
            code = exc.code
    return Done(code, out.getvalue(), err.getvalue())


def bar_lines(text: str) -> list[str]:
    """The training progress bar's drawn lines (tqdm redraws with carriage returns)."""
    return [line for line in re.split(r"[\r\n]", text) if re.match(r"(Epoch \d+|Training):", line)]


#: four batches per epoch: a run can stop, or resume, mid-epoch
FOUR_BATCHES = [*[o for o in SMALL if not o.startswith("data.num_train")], "data.num_train=32"]


def test_the_progress_bars_last_line_and_the_summary_show_the_same_validation(tmp_path):
    done = gpipe_train(tmp_path, "experiment=transformer_tiny", "logger=none", "trainer=smoke",
                       "trainer.max_steps=6", "trainer.enable_progress_bar=true", "data.num_train=32",
                       "data.batch_size=8", "data.num_val=8", "data.max_len=6", "model.d_model=32",
                       "model.ffn_dim=64")
    assert done.code in (0, None), done.err[-3000:]
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert summary["steps"] == 6 and summary["validation_metric"] == "val/bleu"  # 4 batches an epoch: mid-epoch
    last = bar_lines(done.out + done.err)[-1]
    assert last.startswith("Epoch 1:"), last
    shown = dict(re.findall(r"(val/\w+)=([-\d.]+)", last))
    # tqdm shows 3 significant digits
    assert float(shown["val/loss"]) == float(f"{summary['val_loss']:.3g}"), (last, summary["val_loss"])
    assert float(shown["val/bleu"]) == float(f"{summary['validation_value']:.3g}"), last


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, Done]:
    """A wandb-logged run of 4 steps (checkpoints at steps 2 and 4), then ``ckpt_path=<its step-2
    checkpoint>``: mid-epoch, from a checkpoint its run's history went past, as a kill -9 after
    that checkpoint leaves it."""
    tmp_path = tmp_path_factory.mktemp("resume")
    run = [o for o in FOUR_BATCHES if o != "logger=none"]
    killed = gpipe_train(tmp_path, *run, "logger=wandb", "trainer.max_steps=4", "trainer.enable_checkpointing=true",
                         "callbacks.checkpoint_every_n_steps=2", "callbacks.keep_checkpoints=-1", "hydra.run.dir=killed")
    assert killed.code in (0, None), killed.err[-3000:]
    ckpt = tmp_path / "killed" / "checkpoints" / "epoch=0-step=2.ckpt"
    done = gpipe_train(tmp_path, "trainer.max_steps=4", "trainer.enable_progress_bar=true", f"ckpt_path='{ckpt}'",
                       "hydra.run.dir=resumed")
    assert done.code in (0, None), done.err[-3000:]
    return tmp_path, done


def test_a_mid_epoch_resume_shows_its_epoch_and_total_and_no_noise(resumed):
    _, done = resumed
    console = done.out + done.err
    drawn = [line for line in bar_lines(console) if "train/loss" in line]  # after a resumed step
    assert drawn and all(line.startswith("Epoch 0:") and re.search(r"\| [34]/4 ", line) for line in drawn), drawn
    for noise in ("(wandb id None)", "overrides []", "litlogger", "weights_only", "dirpath has changed",
                  "Total FLOPs"):
        assert noise not in console, noise
    final = done.out.strip().splitlines()[-1]
    assert final.startswith("summary: K=2 M=4 train_loss="), final
    assert not re.search(r"\d\.\d{5,}", final), final  # rounded


def test_a_resumed_wandb_run_leaves_one_value_per_step(resumed):
    tmp_path, done = resumed
    (before,), (after,) = find_run_files(tmp_path / "killed"), find_run_files(tmp_path / "resumed")
    old, new = read_run(before), read_run(after)
    assert after.stem == before.stem  # the same wandb run id
    assert [r["trainer/global_step"] for r in old.history if "train/loss" in r] == [0, 1, 2, 3]
    point = branch_point(new)
    assert point is not None and point[0] == before.stem.removeprefix("run-"), (new.config.get("_wandb"),
                                                                                 done.err[-3000:])
    history = synced_history([old, new])
    steps = [r["trainer/global_step"] for r in history if "train/loss" in r]
    assert steps == [0, 1, 2, 3], steps  # steps 2 and 3 once each: the resumed run's
    assert [r["train/loss"] for r in history if "train/loss" in r][2:] == new.metric("train/loss")


def test_the_wandb_readers_text_agrees_with_its_json_and_the_training_step(resumed, capsys):
    """``python -m gpipe_lab.app.wandb_reader <run>`` on the two real offline runs: each row printed is
    (training step, value) of a --json row, the first and the last included; the resumed run names
    its checkpoint's training step."""
    tmp_path, _ = resumed
    (killed_file,) = find_run_files(tmp_path / "killed")
    for folder, note in (("killed", None), ("resumed", f"resumes run {killed_file.stem.removeprefix('run-')} "
                                                       "from its checkpoint at training step 2")):
        assert reader_main([str(tmp_path / folder), "--json"]) == 0
        history = json.loads(capsys.readouterr().out)["history"]
        rows = [(r["trainer/global_step"], r["train/loss"]) for r in history if "train/loss" in r]
        assert reader_main([str(tmp_path / folder)]) == 0
        text = capsys.readouterr().out
        assert f"train/loss over {len(rows)} logged steps" in text, text
        shown = [(int(s), float(v)) for s, v in re.findall(r"^  step +(\d+)  (\S+)$", text, re.M)]
        assert shown == [(s, float(f"{v:.4g}")) for s, v in rows], (shown, rows)  # under 20 rows: all of them
        assert (note is None and "resumes" not in text) or (note is not None and note in text), text


#: Adam at this rate makes the loss NaN by the second step, which stops the run (pipeline.nonfinite=raise)
DIVERGING = [*FOUR_BATCHES, "trainer.max_steps=8", "optimizer.lr=1e12"]


def test_a_run_that_fails_in_training_keeps_its_checkpoint_with_a_summary_of_the_failure(tmp_path):
    done = gpipe_train(tmp_path, *DIVERGING, "trainer.enable_checkpointing=true",
                       "callbacks.checkpoint_every_n_steps=1", "callbacks.keep_checkpoints=1")
    assert done.code == 1 and "NonFiniteError: step 1: loss is nan" in done.err, (done.code, done.err[-2000:])
    (run_dir,) = tmp_path.glob("train/runs/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failed"].startswith("NonFiniteError: step 1: loss is nan") and summary["steps"] == 1, summary
    assert "failed at step 1: NonFiniteError" in done.out and str(run_dir) in done.out
    # one checkpoint file: the numbered copy and last.ckpt are two names of it
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["epoch=0-step=1.ckpt", "last.ckpt"], names
    assert len({p.stat().st_ino for p in (run_dir / "checkpoints").iterdir()}) == 1


def test_a_run_that_fails_in_training_with_nothing_to_keep_leaves_no_folder(tmp_path):
    done = gpipe_train(tmp_path, *DIVERGING)  # no checkpoint, no logger
    assert done.code == 1 and "NonFiniteError: step 1: loss is nan" in done.err, (done.code, done.err[-2000:])
    assert not list(tmp_path.glob("train/runs/*")), list(tmp_path.rglob("*"))


def test_the_timeline_picture_names_d_and_transport_and_explains_what_it_draws(tmp_path, monkeypatch):
    import matplotlib.colors

    from gpipe_lab.plotting import timeline as plotting

    figures = []
    original = plotting.plot_timeline

    def keep(*args, **kwargs):
        figures.append(original(*args, **kwargs))
        return figures[-1]
    monkeypatch.setattr(plotting, "plot_timeline", keep)
    done = gpipe_train(tmp_path, *SMALL, "trainer.max_steps=1", "pipeline.schedule=zb-h1", "pipeline.checkpoint=never")
    assert done.code in (0, None), done.err[-3000:]
    figure = figures[-1]
    assert figure._suptitle.get_text().startswith("K=2 M=4 D=1 zb-h1 transport=local"), figure._suptitle
    measured, predicted = figure.axes
    drawn = {matplotlib.colors.to_hex(p.get_facecolor()) for ax in figure.axes for p in ax.patches}
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert "recompute" not in legend and legend == [plotting.LABELS[k] for k, c in plotting.COLORS.items() if c in drawn]
    assert plotting.CAPTION in [t.get_text() for t in figure.texts]  # grey and white explained
    weight_blocks = [p for p in predicted.patches if matplotlib.colors.to_hex(p.get_facecolor()) == plotting.COLORS["W"]]
    assert len(weight_blocks) == 2 * 4 and all(p.get_width() > 0 for p in weight_blocks)  # zb-h1's W, every stage

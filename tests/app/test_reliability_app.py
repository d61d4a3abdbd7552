"""``gpipe-train`` under interruption: Ctrl-C and SIGKILL lose nothing, and runs are bitwise repeatable.

Every test starts the real console app (``python -m gpipe_lab.app.train``, forked: ``helpers.forked``)
with a small AmoebaNet-D config (4 steps per epoch, a checkpoint every 3 optimizer steps,
all of them kept, per-step losses in the CSV logger), follows its steps on the progress bar
it prints (bounded by each test's timeout mark), and kills its whole process group in ``finally``.

- An uninterrupted 20-step run is the reference (module fixture).
- The same config again (with ``pipeline.checkpoint=always``): the 20 losses are
  bitwise identical (same seed, same K and M, whatever the re-materialization).
- SIGKILL after the step-9 checkpoint (mid-epoch), then ``ckpt_path=<it>``: every resumed
  step has bitwise the reference's loss; ``last.ckpt`` is complete and at most one checkpoint behind the newest.
- SIGINT (Ctrl-C) mid-epoch: the app finishes the step, writes ``checkpoints/last.ckpt``, the
  summary (marked interrupted) and the last timeline picture, prints the resume command with
  the user's overrides, exits with status 1 (no hang), and resuming from it continues with the
  reference's losses.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch

from helpers.forked import ForkedProcess

pytestmark = [pytest.mark.slow]

STEPS = 20
STEPS_PER_EPOCH = 4
APP = [
    "logger=csv", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=0", "+trainer.enable_model_summary=false",
    f"data.num_train={8 * STEPS_PER_EPOCH}", "data.num_val=8", "data.batch_size=8",
    "model.num_filters=8", "data.image_size=8", "model.image_size=8",
    "pipeline.partitions=2", "pipeline.chunks=4", "seed=3",
    "pipeline.threads_per_stage=1",  # runs compared bitwise: not the default, which follows the load
    "callbacks.checkpoint_every_n_steps=3", "callbacks.keep_checkpoints=-1",
]
#: The interruption tests follow the app's steps on its progress bar.
PROGRESS_BAR = ["trainer.enable_progress_bar=true"]


def start_app(run_dir: Path, *overrides: str, sigint_ignored: bool = False) -> ForkedProcess:
    """The app in its own session with its console (stdout and stderr) on a pipe; ``console()`` shows
    what was read. ``sigint_ignored``: what ``gpipe-train ... &`` in a script does to the child."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    proc = ForkedProcess("gpipe_lab.app.train", [*APP, *overrides, f"hydra.run.dir={run_dir}",
                                             f"paths.log_dir={run_dir.parent / 'logs'}"],
                         cwd=run_dir, env=env, new_session=True, sigint_ignored=sigint_ignored)
    proc.log = open(run_dir / "console.log", "wb")  # type: ignore[attr-defined]  # noqa: SIM115 - closed by stop()
    return proc


def drain(proc: ForkedProcess) -> int:
    """Read the app's console to its end (into console.log); returns its exit status."""
    for chunk in iter(lambda: proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
        proc.log.write(chunk)  # type: ignore[attr-defined]
    return proc.wait(timeout=60)


def stop(proc: ForkedProcess) -> None:
    """Kill the app and everything it started (its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    proc.stdout.close()  # type: ignore[union-attr]
    proc.log.close()  # type: ignore[attr-defined]


def console(run_dir: Path) -> str:
    return (run_dir / "console.log").read_text(errors="replace")[-4000:]


#: The progress bar's line after each batch: ``Epoch 2:  25%|##  | 1/4 ...``.
PROGRESS = re.compile(rb"Epoch (\d+):\s+\d+%\|[^|]*\| (\d+)/\d+")


def wait_for_step(proc: ForkedProcess, run_dir: Path, steps: int) -> None:
    """Block on the app's console until its progress bar shows ``steps`` finished batches.

    Lightning runs checkpoint callbacks after every other batch-end hook, so once the bar
    shows batch n + 1, the checkpoint of step n is completely written. Bounded by the
    test's timeout mark.
    """
    tail = b""
    while True:
        chunk = proc.stdout.read1(65536)  # type: ignore[union-attr]  # blocks until the app writes
        proc.log.write(chunk)  # type: ignore[attr-defined]
        assert chunk, f"the app ended early:\n{console(run_dir)}"
        tail = (tail + chunk)[-8192:]
        done = max((int(epoch) * STEPS_PER_EPOCH + int(batch) for epoch, batch in PROGRESS.findall(tail)), default=0)
        if done >= steps:
            return


def run_app(run_dir: Path, *overrides: str) -> dict[int, float]:
    proc = start_app(run_dir, *overrides)
    try:
        code = drain(proc)
    finally:
        stop(proc)
    assert code == 0, console(run_dir)
    return losses(run_dir)


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step training loss from the CSV logger: {global step: loss} (full float precision)."""
    files = sorted(run_dir.glob("csv/version_*/metrics.csv"))
    out: dict[int, float] = {}
    for path in files:
        try:
            with open(path) as f:
                for row in csv.DictReader(f):
                    if row.get("train/loss"):
                        out[int(row["step"])] = float(row["train/loss"])
        except FileNotFoundError:  # being rewritten
            continue
    return out


def step_of(ckpt: Path) -> int:
    return int(ckpt.stem.rsplit("step=", 1)[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    got = run_app(tmp_path_factory.mktemp("reference") / "run", f"trainer.max_steps={STEPS}")
    assert sorted(got) == list(range(STEPS)), got
    return got


@pytest.mark.timeout(300)
def test_app_same_seed_same_k_m_is_bitwise_identical_over_20_steps(reference, tmp_path):
    again = run_app(tmp_path / "run", f"trainer.max_steps={STEPS}", "pipeline.checkpoint=always")
    assert again == reference  # float equality of every step


@pytest.mark.timeout(600)
def test_sigkill_then_resume_continues_with_the_same_losses(reference, tmp_path):
    killed_dir, resumed_dir = tmp_path / "killed", tmp_path / "resumed"
    proc = start_app(killed_dir, f"trainer.max_steps={3 * STEPS}", *PROGRESS_BAR)  # it cannot end before the kill
    try:
        wait_for_step(proc, killed_dir, 2 * STEPS_PER_EPOCH + 2)  # the step-9 checkpoint is written
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        stop(proc)
    before = losses(killed_dir)
    assert all(before[s] == reference[s] for s in before if s < STEPS), "the killed run diverged before the kill"
    numbered = sorted(step_of(p) for p in (killed_dir / "checkpoints").glob("*step=*.ckpt"))
    last = torch.load(killed_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    # last.ckpt loads (written, then renamed: never truncated) and is the newest numbered checkpoint,
    # or the one before it when the kill fell between Lightning's two writes (numbered first, then last).
    assert last["global_step"] in numbered[-2:], (last["global_step"], numbered)

    ckpt = killed_dir / "checkpoints" / "epoch=2-step=9.ckpt"  # mid-epoch: 2 epochs of 4 steps, then 1
    first = step_of(ckpt)
    resumed = run_app(resumed_dir, f"trainer.max_steps={STEPS}", f"ckpt_path='{ckpt}'")  # quoted: '=' in the name
    assert sorted(resumed) == list(range(first, STEPS)), resumed
    assert resumed[first] == reference[first], "weights or optimizer state not restored bitwise"
    assert resumed == {s: reference[s] for s in resumed}  # float equality of every resumed step


@pytest.mark.timeout(600)
def test_sigint_stops_cleanly_and_leaves_a_resumable_checkpoint(reference, tmp_path):
    run_dir, resumed_dir = tmp_path / "interrupted", tmp_path / "resumed"
    proc = start_app(run_dir, f"trainer.max_steps={3 * STEPS}", *PROGRESS_BAR)  # it cannot end before the signal
    try:
        wait_for_step(proc, run_dir, STEPS_PER_EPOCH + 1)  # mid-epoch, after the step-3 checkpoint
        os.killpg(proc.pid, signal.SIGINT)
        code = drain(proc)  # graceful: no hang on worker threads or loggers
    finally:
        stop(proc)
    text = console(run_dir)
    assert code == 1 and "Detected KeyboardInterrupt, attempting graceful shutdown" in text, (code, text)
    assert "Ctrl-C: stopping after the current step" in text, text
    checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert checkpoints, f"no checkpoint left behind:\n{text}"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.exists(), f"Ctrl-C did not write last.ckpt:\n{text}"
    lines = [line for line in text.splitlines() if line.strip()]
    resume = f"resume with: {shlex.join(['gpipe-train', *APP[:3]])} "  # the user's overrides, retyped
    assert lines[-1].startswith(resume) and lines[-1].endswith(f"ckpt_path={last}"), text  # the last line
    assert lines[-2].startswith("summary: K=2") and lines[-2].endswith("(interrupted)"), text
    assert lines[-1] in (run_dir / "train.log").read_text() and lines[-2] in (run_dir / "train.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] >= 1, summary
    assert (run_dir / "timeline_last.png").is_file()
    ckpt = Path(shutil.copy(last, tmp_path / "interrupted.ckpt"))
    saved_step = int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"])
    assert STEPS_PER_EPOCH < saved_step <= STEPS - STEPS_PER_EPOCH, saved_step  # within the reference's steps
    before = losses(run_dir)
    assert sorted(before) == list(range(saved_step)), (saved_step, before)  # every finished step was logged
    assert before == {s: reference[s] for s in before}

    resumed = run_app(resumed_dir, f"trainer.max_steps={saved_step + STEPS_PER_EPOCH}", f"ckpt_path={ckpt}")
    assert sorted(resumed) == list(range(saved_step, saved_step + STEPS_PER_EPOCH)), (saved_step, resumed)
    assert resumed[saved_step] == reference[saved_step]
    assert resumed == {s: reference[s] for s in resumed}  # float equality of every resumed step


@pytest.mark.timeout(600)
def test_sigint_stops_every_rank_of_a_distributed_run_started_from_a_script(tmp_path):
    """``gpipe-train pipeline.transport=distributed ... &`` from a script starts with SIGINT ignored;
    kill -INT on the main pid still stops every rank after the step it interrupted and leaves what
    the local transport leaves: that step's checkpoint, the summary and the resume command."""
    run_dir = tmp_path / "distributed"
    proc = start_app(run_dir, "pipeline.transport=distributed", f"trainer.max_steps={100 * STEPS}",
                     *PROGRESS_BAR, sigint_ignored=True)
    try:
        wait_for_step(proc, run_dir, STEPS_PER_EPOCH + 1)  # after the step-3 checkpoint
        os.kill(proc.pid, signal.SIGINT)
        code = drain(proc)  # to the end of every rank's output: no rank goes on training
    finally:
        stop(proc)
    text = console(run_dir)
    assert code == 1, (code, text)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] < 100 * STEPS, summary
    assert (run_dir / "timeline_last.png").is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    # the interrupted step, as the local transport saves it, not the step-3 periodic checkpoint
    assert saved["global_step"] == summary["steps"] > STEPS_PER_EPOCH, (saved["global_step"], summary["steps"])
    log = [line for line in (run_dir / "train.log").read_text().splitlines() if line.strip()]
    assert "resume with: gpipe-train" in log[-1] and log[-1].endswith(f"ckpt_path={run_dir}/checkpoints/last.ckpt")
    assert "Traceback" not in text, text

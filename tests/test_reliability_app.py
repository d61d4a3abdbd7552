"""``gpipe-train`` under interruption: Ctrl-C and SIGKILL lose nothing, and runs are bitwise repeatable.

Every test starts the real console app (``python -m gpipe_lab.train``) in a subprocess
with a small AmoebaNet-D config (4 steps per epoch, a checkpoint at every epoch end,
per-step losses in the CSV logger), bounds it with a deadline, and kills its whole
process group in ``finally``.

- An uninterrupted 20-step run is the reference (module fixture).
- The same config again (with ``pipeline.checkpoint=always``): the 20 losses are
  bitwise identical (same seed, same K and M, whatever the re-materialization).
- SIGKILL after the step-8 checkpoint, then ``ckpt_path=<it>``: the killed run's own steps
  and the first resumed step have bitwise the reference's losses; the steps after should
  too, but Lightning's epoch bookkeeping on resume feeds other batches (xfail, see
  ``LIGHTNING_RESUME_BUG`` and docs/reliability.md).
- SIGINT after the first checkpoint: the app exits promptly (no hang), leaves a
  checkpoint, and resuming from it continues (same caveat).
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow]

STEPS = 20
STEPS_PER_EPOCH = 4
APP = [
    "logger=csv", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=0", "+trainer.enable_model_summary=false",
    f"data.num_train={8 * STEPS_PER_EPOCH}", "data.num_val=8", "data.batch_size=8",
    "model.num_filters=8", "data.image_size=8", "model.image_size=8",
    "pipeline.partitions=2", "pipeline.chunks=4", "seed=3",
]
RUN_DEADLINE = 240.0


def start_app(run_dir: Path, *overrides: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "console.log", "wb")  # noqa: SIM115 - closed with the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpipe_lab.train", *APP, *overrides, f"hydra.run.dir={run_dir}",
         f"paths.log_dir={run_dir.parent / 'logs'}"],
        cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Kill the app and everything it started (its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    proc.log.close()  # type: ignore[attr-defined]


def console(run_dir: Path) -> str:
    return (run_dir / "console.log").read_text(errors="replace")[-4000:]


def run_app(run_dir: Path, *overrides: str) -> dict[int, float]:
    proc = start_app(run_dir, *overrides)
    try:
        code = proc.wait(timeout=RUN_DEADLINE)
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


def checkpoint_at(run_dir: Path, min_step: int) -> Path | None:
    """The newest epoch checkpoint at a step >= ``min_step`` (ModelCheckpoint deletes older ones)."""
    found = sorted((int(p.stem.rsplit("step=", 1)[1]), p) for p in (run_dir / "checkpoints").glob("*step=*.ckpt"))
    found = [(step, p) for step, p in found if step >= min_step]
    return found[-1][1] if found else None


def step_of(ckpt: Path) -> int:
    return int(ckpt.stem.rsplit("step=", 1)[1])


def wait_for(predicate, proc: subprocess.Popen, run_dir: Path, timeout: float = RUN_DEADLINE):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"the app ended early:\n{console(run_dir)}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting; console:\n{console(run_dir)}")


def stable_file(path_fn):
    """A predicate: the file exists and its size did not change over 0.5 s (write finished)."""
    def check():
        path = path_fn()
        try:
            size = path.stat().st_size if path is not None else 0
            time.sleep(0.5)
            return path if size > 0 and path.stat().st_size == size else None
        except FileNotFoundError:  # replaced by a newer checkpoint meanwhile
            return None

    return check


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
    proc = start_app(killed_dir, f"trainer.max_steps={STEPS}")
    try:
        ckpt = wait_for(stable_file(lambda: checkpoint_at(killed_dir, 2 * STEPS_PER_EPOCH)), proc, killed_dir)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        stop(proc)
    before = losses(killed_dir)
    assert all(before[s] == reference[s] for s in before), "the killed run diverged before the kill"

    resumed = run_app(resumed_dir, f"trainer.max_steps={STEPS}", f"ckpt_path='{ckpt}'")
    first = step_of(ckpt)
    assert first % STEPS_PER_EPOCH == 0 and first < STEPS
    assert sorted(resumed) == list(range(first, STEPS)), resumed
    assert resumed[first] == reference[first], "weights or optimizer state not restored bitwise"
    expect_same_continuation(resumed, reference)


LIGHTNING_RESUME_BUG = (
    "Lightning 2.6 resumed from an epoch-end checkpoint does not replay the uninterrupted run's epochs: "
    "without validation the next epoch runs ONE batch, then the epoch after starts (sampler epoch +1); "
    "with validation the whole next epoch is skipped (set_epoch off by one). Steps after the first "
    "resumed one therefore see other batches. See docs/reliability.md, 'Resume'."
)


def expect_same_continuation(resumed: dict[int, float], reference: dict[int, float]) -> None:
    """Every resumed step must have the reference's loss; known not to hold yet (xfail, not skip)."""
    if resumed != {s: reference[s] for s in resumed}:
        pytest.xfail(LIGHTNING_RESUME_BUG)


@pytest.mark.timeout(600)
def test_sigint_stops_cleanly_and_leaves_a_resumable_checkpoint(reference, tmp_path):
    run_dir, resumed_dir = tmp_path / "interrupted", tmp_path / "resumed"
    proc = start_app(run_dir, f"trainer.max_steps={STEPS}")
    try:
        wait_for(stable_file(lambda: checkpoint_at(run_dir, STEPS_PER_EPOCH)), proc, run_dir)
        wait_for(lambda: len(losses(run_dir)) > STEPS_PER_EPOCH, proc, run_dir, timeout=60)  # mid-epoch
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)  # graceful: no hang on worker threads or loggers
    finally:
        stop(proc)
    text = console(run_dir)
    assert code == 1 and "Detected KeyboardInterrupt, attempting graceful shutdown" in text, (code, text)
    assert len(losses(run_dir)) < STEPS
    checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert checkpoints, f"no checkpoint left behind:\n{text}"
    last = run_dir / "checkpoints" / "last.ckpt"
    ckpt = last if last.exists() else checkpoints[-1]
    ckpt = Path(shutil.copy(ckpt, tmp_path / "interrupted.ckpt"))  # a name without '='
    saved_step = int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"])
    assert saved_step < STEPS

    resumed = run_app(resumed_dir, f"trainer.max_steps={saved_step + STEPS_PER_EPOCH}", f"ckpt_path='{ckpt}'")
    assert resumed, console(resumed_dir)
    first = min(resumed)
    assert first == saved_step and resumed[first] == reference[first]
    expect_same_continuation(resumed, reference)

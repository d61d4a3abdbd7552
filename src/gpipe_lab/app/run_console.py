"""What ``gpipe-train`` tells its user on the console and in ``train.log``.

The pipeline's stages before training (instead of Lightning's one-row model summary), a note
while ``pipeline.compile`` builds kernels, the final summary line, and after Ctrl-C the summary
and the resume command as the last lines; Lightning's own lines once and without its
advertising; no run folder left by a refused or dry run, nor by a failed one with nothing to keep.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only

from gpipe_lab.lightning.callbacks import PipelineMetrics
from gpipe_lab.lightning.resume import ResumableCheckpoint, resume_command
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.pipeline.partitioning.partition import resolve_balance


def global_rank() -> int:
    """This process's global rank as Lightning sets it (``rank_zero_only.rank``, an attribute the
    type stubs do not declare); 0 before any launcher set one."""
    return int(getattr(rank_zero_only, "rank", 0))


def stage_summary(options: PipelineOptions, layers: Any) -> str:
    """The pipeline as it will run: K, M, schedule, and each stage's layers and parameters."""
    balance = resolve_balance(layers, options)
    lines = [f"pipeline: K={options.num_stages} M={options.chunks} schedule={options.schedule} "
             f"checkpoint={options.checkpoint} transport={options.transport}"]
    first = 0
    for index, count in enumerate(balance):
        params = sum(p.numel() for layer in list(layers)[first:first + count] for p in layer.parameters())
        lines.append(f"  stage {index}: layers {first}-{first + count - 1} ({count}), {params:,} parameters")
        first += count
    return "\n".join(lines)


class CompileNotice(pl.Callback):
    """``pipeline.compile``: the first training step builds every stage's kernels (minutes on a
    CPU), and so does the first validation or test batch (evaluation runs without gradients: other
    kernels), which the progress bar's estimate cannot know: say so before each, and how long it
    took after."""

    #: what each phase's first batch compiles
    PHASES = {"train": "the first step", "validation": "the first validation batch (no gradients: other kernels)",
              "test": "the first test batch (no gradients: other kernels)"}

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.told: set[str] = set()

    def _start(self, trainer: pl.Trainer, phase: str) -> None:
        if phase in self.told or not trainer.is_global_zero or trainer.sanity_checking:
            return
        self.told.add(phase)
        self.started[phase] = time.monotonic()
        what = self.PHASES[phase]
        print(f"pipeline.compile: torch.compile is building each stage's kernels during {what}; this can take "
              "minutes on a CPU, and the progress bar's estimate means nothing until then", flush=True)

    def _end(self, phase: str) -> None:
        started = self.started.pop(phase, None)
        if started is not None:
            print(f"pipeline.compile: {self.PHASES[phase].split(' (')[0]}, compilation included, took "
                  f"{time.monotonic() - started:.1f} s", flush=True)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start(trainer, "train")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end("train")

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._start(trainer, "validation")

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end("validation")

    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self._start(trainer, "test")

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end("test")


class ProgressBar(TQDMProgressBar):
    """Lightning's bar, also when a run resumes mid-epoch: Lightning then skips the epoch's start,
    which would leave the bar without its epoch, its total or its count (``Training: 48/?``)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.fit_loop.restarted_mid_epoch:
            self.on_train_epoch_start(trainer, pl_module)
            current = trainer.fit_loop.epoch_loop.batch_progress.current
            bar, done = self.train_progress_bar, current.processed  # type: ignore[attr-defined]  # a _ProcessedTracker, typed as its base
            if bar.total is not None:  # Lightning's total counts the steps left to max_steps from here
                bar.total = min(done + bar.total, trainer.num_training_batches)
            bar.n = bar.initial = done
            bar.refresh()


class ValidateAtTheEnd(pl.Callback):
    """Validate the final model inside ``fit`` when training stops mid-epoch (``max_steps``), as the
    last step of every epoch does: the progress bar's last line then shows the validation metric
    of the same step as the run's summary, not an earlier epoch's."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.enable_validation and ResumableCheckpoint.is_final_step(trainer):
            trainer.should_stop = True  # Lightning validates before it stops (fit_loop's early-stop rule)


def close_progress_bars(trainer: pl.Trainer) -> None:
    """Close the progress bars now: tqdm would otherwise redraw them at exit, below the last lines."""
    bar = trainer.progress_bar_callback
    for name in ("_train_progress_bar", "_val_progress_bar"):
        tqdm_bar = getattr(bar, name, None)
        if tqdm_bar is not None:
            tqdm_bar.close()
    sys.stderr.flush()


def tell(line: str) -> None:
    """Print ``line`` and add it to the run's ``train.log`` (Hydra's file handler)."""
    print(line, flush=True)
    record = logging.LogRecord(__name__, logging.INFO, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def tell_interrupted(metrics: PipelineMetrics, output_dir: Path) -> None:
    """After Ctrl-C: the summary line, then the command that resumes the run, as the last lines
    (after wandb's closing block) and in ``train.log``."""
    tell(summary_line(metrics.summary, output_dir) + " (interrupted)")
    last = output_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        tell(f"resume with: {resume_command(last)}")


def summary_line(summary: dict[str, Any], output_dir: Path) -> str:
    """The run's one line of its own at the end: what ran (K, M, loss, metric and throughput,
    rounded; the run's name), where its summary is, its timeline pictures and its wandb folder."""
    def short(value: Any) -> Any:
        return f"{value:.4g}" if isinstance(value, float) else value

    figures = {"train_loss": summary.get("final_train_loss"), summary.get("validation_metric"):
               summary.get("validation_value"), summary.get("test_metric"): summary.get("test_value"),
               "samples/s": summary.get("samples_per_s")}
    shown = " ".join(f"{k}={short(v)}" for k, v in figures.items() if k is not None and v is not None)
    line = (f"summary: K={summary.get('K')} M={summary.get('M')} {shown} run={summary.get('run_name')} "
            f"-> {output_dir / 'summary.json'}")
    pictures = [str(p) for p in (output_dir / "timeline_first.png", output_dir / "timeline_last.png") if p.is_file()]
    if pictures:
        line += f"; timelines {' '.join(pictures)}"
    wandb_runs = sorted((output_dir / "wandb").glob("*run-*-*"), key=lambda p: p.name.split("run-", 1)[1])
    if wandb_runs:
        line += f"; wandb {wandb_runs[-1]}"
    return line


def print_lightning_logs_once() -> None:
    """Lightning's loggers print through Hydra's handlers only.

    Lightning gives its ``lightning`` logger a console handler of its own when it is
    imported before logging is set up (here: by a Hydra callback), so each INFO line
    would print twice, once in each format.
    """
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, NoAdvertising) for f in tips.filters):
        tips.addFilter(NoAdvertising())


class NoAdvertising(logging.Filter):
    """Drops Lightning's tip advertising a cloud logger and its echo of ``limit_val_batches=1.0``
    (the default, "100% of the batches will be used"), printed on every run and sweep job."""

    NOISE = ("litlogger", "was configured so 100% of the batches")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise in str(record.msg) for noise in self.NOISE)


#: What Hydra and ``continue_run`` put in a run directory before anything trains.
BEFORE_TRAINING = {".hydra", "train.log", "resumed_run"}


def holds_results(run_dir: Path) -> bool:
    """Whether a failed run's folder holds something to keep: a checkpoint or a logger's output."""
    return any((run_dir / "checkpoints").glob("*.ckpt")) or any((run_dir / d).exists() for d in ("csv", "wandb"))


def record_failure(metrics: PipelineMetrics, trainer: pl.Trainer, output_dir: Path, exc: BaseException) -> None:
    """A run that failed while training: when its folder holds a checkpoint or a log, its
    ``summary.json`` says how it failed (``failed``) and where it stopped; else nothing is written
    (``discard_run_dir(failed=True)`` removes the folder)."""
    if not trainer.is_global_zero or not holds_results(output_dir):
        return
    metrics.extra_summary["failed"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    try:
        metrics.write_summary(trainer)
    except Exception:  # noqa: BLE001 - the run's own error is the one to report
        summary = {"run_dir": output_dir.name, **metrics.extra_summary, "steps": trainer.global_step}
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    tell(f"failed at step {trainer.global_step}: {metrics.extra_summary['failed']}; kept {output_dir} "
         f"(summary.json, its checkpoint and logs)")


def discard_run_dir(failed: bool = False) -> None:
    """Remove a single run's directory when it holds only what was there before training (a
    refused or dry run leaves nothing behind), or for a run that ``failed``, unless it holds a
    checkpoint or a log; a sweep's job folders stay (the sweep numbers them)."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not a Hydra run (tests call ``run``)
        return
    if hydra_cfg.mode != RunMode.RUN or not hydra_cfg.runtime.output_dir:
        return
    if global_rank() != 0:  # a process in rank 0's folder (torchrun: gpipe_lab.app.torchrun_dir; Lightning's launch)
        return
    run_dir = Path(hydra_cfg.runtime.output_dir)
    before = {n for n in os.listdir(run_dir) if not n.endswith(".log")} if run_dir.is_dir() else set()
    if run_dir.is_dir() and (before <= BEFORE_TRAINING or failed and not holds_results(run_dir)):
        shutil.rmtree(run_dir, ignore_errors=True)

"""Interrupt and resume ``gpipe-train``: checkpoints that resume bitwise, Ctrl-C, ``init_from``.

``ResumableCheckpoint`` (a ``ModelCheckpoint``, which names the files from its ``dirpath``
and ``filename`` arguments) writes ``<dir>/last.ckpt`` (and keeps ``save_top_k`` numbered
``epoch=E-step=S.ckpt`` copies; ``last.ckpt`` is then a hard link to the newest: one file on
disk) through ``trainer.save_checkpoint`` at the end of a training batch only:

- every ``every_n_train_steps`` optimizer steps (``callbacks.checkpoint_every_n_steps``);
- at the final step (``max_steps`` or the last batch of ``max_epochs``);
- on the first Ctrl-C (SIGINT): training stops after the current optimizer step, the
  checkpoint is written, then ``KeyboardInterrupt`` is raised at the start of the next batch
  (so that step's metrics are logged), and Lightning shuts down and exits with status 1.
  A second Ctrl-C stops at once (no new checkpoint). With several processes (the
  distributed transport) every rank installs the handler and, at each step's end, the ranks
  agree (one all-reduce) whether any of them was interrupted (``kill -INT`` reaches the main
  process only): they all save that step together and stop.

A batch-end checkpoint is what Lightning 2.6 resumes exactly: with the training loader's
position (``gpipe_lab.data.ResumableDataLoader``) it continues at the next batch of the
same epoch. The global RNG states (torch, CUDA, ``random``, numpy) are saved too and
restored when training starts. So is the intra-op thread count of the CPU stages
(``THREADS_KEY``): kernels reduce in an order that depends on it, and its default follows the
machine's load, so ``resumed_options`` gives the resumed run the recorded count unless
``threads_per_stage`` is set. The pipeline's per-(step, stage, micro-batch) generators
follow from Lightning's restored batch counter (``GPipeStrategy.run_pipeline``). Together: the same
losses as an uninterrupted run, bitwise on CPU with the same K and M.

Never saved at an epoch end or on another exception: Lightning 2.6 resumes an epoch-end
checkpoint with other batches, and an exception can leave a step half done.

``BestCheckpoint`` keeps ``<dir>/best.ckpt`` beside them: the checkpoint of the best validation
value of a monitored metric (``callbacks.model_checkpoint.monitor``), for its weights.

``resolve_ckpt_path`` gives ``ckpt_path=last`` a meaning; ``load_initial_weights`` (from
``gpipe_lab.lightning.init_from``) is ``init_from``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from gpipe_lab.lightning.init_from import load_initial_weights
from gpipe_lab.lightning.rng_states import RNG_KEY, rng_states, set_rng_states
from gpipe_lab.pipeline.options import PipelineOptions

__all__ = ["THREADS_KEY", "BestCheckpoint", "ResumableCheckpoint", "load_initial_weights", "resolve_ckpt_path",
           "resume_command", "resumed_options"]

THREADS_KEY = "gpipe_lab_threads_per_stage"


def resumed_options(options: PipelineOptions, ckpt_path: str | None) -> PipelineOptions:
    """``options`` with the thread count the checkpoint's CPU stages ran with, so the continuation
    computes as the run did; as given where ``threads_per_stage`` is set, without ``ckpt_path``,
    or where the checkpoint recorded none (GPU stages, an older checkpoint)."""
    if ckpt_path is None or options.threads_per_stage is not None:
        return options
    threads = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False).get(THREADS_KEY)
    return options if threads is None else options.replace(threads_per_stage=int(threads))


class ResumableCheckpoint(ModelCheckpoint):
    """See the module docstring.

    Args:
        dirpath: the checkpoint directory (``last.ckpt`` and the numbered copies).
        every_n_train_steps: periodic checkpoints; ``None`` or 0: only at the final step
            and on Ctrl-C.
        save_top_k: numbered copies to keep (-1: all, 0: only ``last.ckpt``).
        handle_sigint: stop cleanly on the first Ctrl-C (see the module docstring).
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int | None = None, save_top_k: int = 1,
                 handle_sigint: bool = True, **kwargs: Any) -> None:
        # ModelCheckpoint names the files; it saves nothing by itself (no trigger, no save_last):
        # every save is a batch-end one, made by save_now
        super().__init__(dirpath=str(dirpath), every_n_epochs=0, save_top_k=save_top_k, save_last=False,
                         enable_version_counter=False, **kwargs)
        self.every_n_train_steps = every_n_train_steps or 0
        self.handle_sigint = handle_sigint
        self._saved_at_step = -1
        self.interrupt_requested = False
        self._sigint_seen = False  # written only by the handler (and reset at train start)
        self._stop_pending = False
        self._previous_handler: Any = None
        self._step_at_batch_start = 0
        self._rng_to_restore: dict[str, Any] | None = None
        self._announce = True

    # ------------------------------------------------------------------ RNG states
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        checkpoint[RNG_KEY] = rng_states()
        checkpoint[THREADS_KEY] = getattr(trainer.strategy, "cpu_threads", None)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self._rng_to_restore = checkpoint.get(RNG_KEY)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._rng_to_restore is not None:  # now: after the loaders were set up, before any step
            set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        self._install_handler(trainer)

    # ------------------------------------------------------------------ Ctrl-C
    def _install_handler(self, trainer: pl.Trainer) -> None:
        self.interrupt_requested = self._stop_pending = self._sigint_seen = False
        self._announce = trainer.is_global_zero
        if not self.handle_sigint or threading.current_thread() is not threading.main_thread():
            return
        self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def _restore_handler(self) -> None:
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous_handler)
        self._previous_handler = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._sigint_seen:  # the second Ctrl-C: stop now
            self._restore_handler()
            raise KeyboardInterrupt
        self._sigint_seen = True  # acted on at the next batch end, by every rank together
        if self._announce:  # rank 0 only: a terminal's Ctrl-C reaches every rank
            print("\nCtrl-C: stopping after the current step and writing the checkpoint "
                  f"{Path(str(self.dirpath)) / 'last.ckpt'} (Ctrl-C again stops at once, without it)",
                  file=sys.stderr, flush=True)

    def _raise_if_stopping(self) -> None:
        if self._stop_pending:
            self._stop_pending = False
            self._restore_handler()
            raise KeyboardInterrupt

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._raise_if_stopping()
        self._step_at_batch_start = trainer.global_step

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._raise_if_stopping()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._raise_if_stopping()  # Ctrl-C during the final step: still stop (the checkpoint is there)
        self._restore_handler()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_handler()
        super().on_exception(trainer, pl_module, exception)
        last = Path(str(self.dirpath)) / "last.ckpt"
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero and last.exists():
            print(f"\nresume with: {resume_command(last)}", file=sys.stderr, flush=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_handler()
        super().teardown(trainer, pl_module, stage)

    # ------------------------------------------------------------------ batch-end saves
    @staticmethod
    def is_final_step(trainer: pl.Trainer) -> bool:
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        return bool(max_epochs is not None and max_epochs != -1 and last_batch
                    and trainer.current_epoch + 1 >= max_epochs)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # The handler only records the signal; the decision is taken here, so that on several ranks
        # it is the same everywhere (a collective, every rank, every batch). A signal that lands
        # after the collective is in the next batch's decision.
        seen = self._sigint_seen
        if self.handle_sigint and trainer.world_size > 1:
            seen = trainer.strategy.reduce_boolean_decision(seen, all=False)
        self.interrupt_requested = seen
        step = trainer.global_step
        stepped = step > self._step_at_batch_start  # not inside an accumulation window
        periodic = bool(self.every_n_train_steps) and step % self.every_n_train_steps == 0
        due = periodic or self.interrupt_requested or self.is_final_step(trainer)
        if stepped and due and step != self._saved_at_step and not getattr(trainer, "fast_dev_run", False):  # set by the Trainer, not in its stubs
            self.save_now(trainer)
        if self.interrupt_requested:
            self._stop_pending = True

    def save_now(self, trainer: pl.Trainer) -> None:
        """Write ``epoch=E-step=S.ckpt`` (unless ``save_top_k=0``) and ``last.ckpt`` (then a hard link
        to it); a collective.

        Names come from ``format_checkpoint_name`` (the ``filename`` argument); with
        ``save_top_k=1`` the previous numbered copy is removed.
        """
        metrics = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
        if self.save_top_k != 0:
            numbered = self.format_checkpoint_name(metrics)
            self._write(trainer, numbered)
            previous = self.best_model_path  # the last numbered copy (restored from a resumed checkpoint)
            same_dir = bool(previous) and Path(previous).parent == Path(numbered).parent
            if self.save_top_k == 1 and same_dir and previous != numbered:
                trainer.strategy.remove_checkpoint(previous)
            self.best_model_path = numbered
        self.last_model_path = self.format_checkpoint_name(metrics, filename=self.CHECKPOINT_NAME_LAST)
        if self.save_top_k != 0:
            self._link(trainer, self.best_model_path, self.last_model_path)
        else:
            self._write(trainer, self.last_model_path)
        self._saved_at_step = trainer.global_step

    @staticmethod
    def _link(trainer: pl.Trainer, numbered: str, last: str) -> None:
        """``last.ckpt`` as a second name of the numbered copy just written: one file on disk, not two."""
        if trainer.is_global_zero:
            partial = f"{last}.partial"
            if os.path.lexists(partial):
                os.remove(partial)
            try:
                os.link(numbered, partial)
            except OSError:  # a file system without hard links
                shutil.copyfile(numbered, partial)
            os.replace(partial, last)
        trainer.strategy.barrier("ResumableCheckpoint.link")

    @staticmethod
    def _write(trainer: pl.Trainer, filepath: str) -> None:
        """Write to ``<file>.partial`` first, then rename: a kill never leaves a truncated file."""
        partial = f"{filepath}.partial"
        trainer.save_checkpoint(partial, weights_only=False)  # said, so Lightning does not log its default
        if trainer.is_global_zero:
            os.replace(partial, filepath)
        trainer.strategy.barrier("ResumableCheckpoint.replace")


class BestCheckpoint(pl.Callback):
    """``<dirpath>/best.ckpt``: rewritten at the end of a validation (in ``fit``) whose ``monitor``
    value beats every earlier one of the run (a resumed run included: the best value is saved in
    the checkpoints). It is for the weights (``init_from``, export, evaluation): a validation may
    end an epoch, where Lightning would not resume exactly, so runs resume from ``last.ckpt``.

    Args:
        dirpath: the checkpoint directory.
        monitor: a metric the validation logs, e.g. ``val/acc``, ``val/bleu``, ``val/loss``.
        mode: ``max`` or ``min``; ``None``: ``min`` for a loss, else ``max``.
    """

    def __init__(self, dirpath: str | Path, monitor: str, mode: str | None = None) -> None:
        self.path = Path(dirpath) / "best.ckpt"
        self.monitor = monitor
        self.mode = mode or ("min" if monitor.endswith("loss") else "max")
        self.best: float | None = None

    @property
    def state_key(self) -> str:
        return f"BestCheckpoint[{self.monitor}]"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metric = trainer.callback_metrics.get(self.monitor)
        value = None if metric is None else float(metric)
        better = value is not None and (self.best is None or (value > self.best if self.mode == "max"
                                                               else value < self.best))
        if trainer.strategy.broadcast(better, src=0):  # rank 0 decides: saving is a collective
            self.best = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            ResumableCheckpoint._write(trainer, str(self.path))


def resume_command(last: Path) -> str:
    """This process's ``gpipe-train`` command line with ``ckpt_path`` set to ``last``."""
    import shlex

    args = [a for a in sys.argv[1:] if not a.startswith(("ckpt_path=", "init_from="))]
    return shlex.join(["gpipe-train", *args, f"ckpt_path={last}"])


# ---------------------------------------------------------------------- ckpt_path=last
def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path | None, runs_dir: Path | None = None) -> str | None:
    """``ckpt_path`` for ``Trainer.fit``: a path as given, or ``"last"``: this run directory's
    ``checkpoints/last.ckpt`` when it exists (``hydra.run.dir=<an old run>``; none without
    ``output_dir``), else the newest ``*/checkpoints/last.ckpt`` under ``runs_dir`` (the app's
    ``logs/<task>/runs``).

    Raises:
        FileNotFoundError: ``last`` and no such checkpoint exists.
    """
    if ckpt_path is None or str(ckpt_path) != "last":
        return None if ckpt_path is None else str(ckpt_path)
    own = output_dir / "checkpoints" / "last.ckpt" if output_dir is not None else None
    if own is not None and own.is_file():
        return str(own)
    found = sorted(runs_dir.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime) if runs_dir else []
    if not found:
        raise FileNotFoundError(f"ckpt_path=last: no checkpoints/last.ckpt in {output_dir} nor under {runs_dir}")
    return str(found[-1])

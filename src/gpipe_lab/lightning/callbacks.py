"""``PipelineMetrics``: throughput, bubble, per-stage busy time and memory, timeline pictures,
and the run's ``summary.json``.

Logged every ``log_every_n_steps`` (through the LightningModule, so every logger gets it), and
always at the first and the last step (straight to the loggers, with ``train/loss``, when
Lightning would skip them): ``perf/samples_per_s``, ``perf/tokens_per_s``,
``pipeline/bubble_measured`` (that step's), ``pipeline/bubble_theory`` (the schedule's own idle
fraction, simulated at equal forward/backward/weight costs: ``theory_bubble``),
``pipeline/stage{k}_busy_s``, ``memory/stage{k}_param_bytes``,
``memory/stage{k}_activation_bytes``. The timeline picture (the measured step above the
simulator's prediction from its action times; K, M, D and the transport in its title) is
saved (and sent to wandb as ``pipeline/timeline``) at the first logged step and at the end of
training (Ctrl-C too).

``summary.json`` uses the history's names for the same figures (``train/loss``,
``perf/samples_per_s``, ``pipeline/bubble_measured``: the MEAN over the steps after the first,
``bubble_measured_over`` says so) and keeps the flat names (``final_train_loss``,
``samples_per_s``, ``tokens_per_s``, ``bubble_measured``, ``bubble_theory``) as aliases. It
also holds the run name, optimizer, learning rate, D (data-parallel replicas), the run's
command-line overrides (``overrides``, given by the app: so a sweep's rows show what each job swept) and, once the final model
is tested (``gpipe_lab.app.evaluation``), the test metrics.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor

from gpipe_lab.lightning.strategy import GPipeStrategy
from gpipe_lab.lightning.timeline_figure import predicted_timeline, save_timeline_figure

#: The flat summary names kept as aliases of the history's names.
ALIASES = {"final_train_loss": "train/loss", "samples_per_s": "perf/samples_per_s",
           "tokens_per_s": "perf/tokens_per_s", "bubble_measured": "pipeline/bubble_measured",
           "bubble_theory": "pipeline/bubble_theory"}


def theory_bubble(schedule: str, num_stages: int, chunks: int, virtual_stages: int = 1) -> float:
    """The schedule's idle fraction predicted by ``gpipe_lab.planner.simulator`` with every
    forward, backward and weight-gradient action costing the same (no transfer time), with
    ``virtual_stages`` stages per rank placed as the schedule places them."""
    from gpipe_lab.planner.simulator import unit_cost_bubble

    return float(unit_cost_bubble(schedule, num_stages, chunks, virtual_stages))


class PipelineMetrics(pl.Callback):
    """See the module docstring. ``output_dir`` receives ``summary.json`` and ``timeline_*.png``."""

    def __init__(self, output_dir: str | Path, extra_summary: dict[str, Any] | None = None,
                 warmup_steps: int = 1,
                 derived: Callable[[dict[str, Any], list[float]], dict[str, Any]] | None = None,
                 overrides: list[str] | None = None, pictures: bool = True) -> None:
        self.output_dir = Path(output_dir)
        #: draw the first and the last step's timeline (``callbacks.timeline_pictures``)
        self.pictures = pictures
        #: the run's command-line overrides (the summary's ``overrides``)
        self.overrides = list(overrides or [])
        self.extra_summary = dict(extra_summary or {})
        #: more summary keys computed from the summary and the counted steps' wall times
        self.derived = derived
        self.step_walls: list[float] = []
        self.warmup_steps = warmup_steps
        self._start = 0.0
        self._fit_start = 0.0
        self._rates: list[tuple[float, float | Tensor]] = []  # a token count stays unread until logged
        self._bubbles: list[float] = []
        self._busy: list[list[float]] = []
        self._pictured = False
        self.last_validated_step = -1
        self._timeline: Any = None
        self._reports = 0  # step reports seen: the last picture is the first one when none came after
        self._pictured_at = -1
        self._memory: list[dict[str, int]] = []
        self.summary: dict[str, Any] = {}

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> GPipeStrategy | None:
        strategy = trainer.strategy
        return strategy if isinstance(strategy, GPipeStrategy) else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        strategy = self._strategy(trainer)
        if strategy is None or strategy.timeline is None:
            return
        seconds = time.perf_counter() - self._start
        samples, tokens = strategy.last_batch_size
        rates = (samples / seconds, tokens / seconds)
        measured = batch_idx >= self.warmup_steps or trainer.max_steps == 1
        from gpipe_lab.lightning.resume import ResumableCheckpoint

        every = getattr(trainer, "log_every_n_steps", 1)  # set by the Trainer, not in its stubs
        skipped_by_lightning = bool(trainer.global_step % max(1, every))
        final = ResumableCheckpoint.is_final_step(trainer)
        quiet = skipped_by_lightning and self._pictured and not final
        if quiet and (strategy.transport == "distributed" or strategy.root_device.type == "cuda"):
            # the step report is a blocking exchange over the pipeline (distributed), or waits for the
            # GPU to read its CUDA events: made on logged steps only
            self._rates += [rates] if measured else []
            return
        timeline, memory = strategy.step_report()  # collective in distributed: every rank calls it
        self._timeline, self._memory = timeline, memory
        self._reports += 1
        assert timeline is not None
        if measured:
            self._rates.append(rates)
            self._bubbles.append(timeline.measured_bubble())
            self._busy.append(timeline.busy())
            self.step_walls.append(timeline.wall)
        if quiet:
            return
        metrics = {"perf/samples_per_s": rates[0], "perf/tokens_per_s": rates[1],
                   "pipeline/bubble_measured": timeline.measured_bubble(),
                   "pipeline/bubble_theory": self._theory(strategy), "pipeline/step_wall_s": timeline.wall}
        for stage, busy in enumerate(timeline.busy()):
            metrics[f"pipeline/stage{stage}_busy_s"] = busy
        for stage, mem in enumerate(memory):
            metrics[f"memory/stage{stage}_param_bytes"] = float(mem["parameter_bytes"])
            metrics[f"memory/stage{stage}_activation_bytes"] = float(mem["peak_activation_bytes"])
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        if skipped_by_lightning:  # the first or the last step of a run shorter than log_every_n_steps
            if strategy.last_loss is not None:
                metrics["train/loss"] = float(strategy.last_loss)
            for logger in trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=trainer.global_step - 1)
        if not self._pictured:
            self._pictured = True
            self._picture(trainer, strategy, "first")

    def _theory(self, strategy: GPipeStrategy) -> float:
        key = (strategy.schedule, strategy.num_stages, strategy.chunks, strategy.virtual_stages)
        if getattr(self, "_theory_key", None) != key:
            self._theory_key, self._theory_value = key, theory_bubble(*key)
        return self._theory_value

    def _picture(self, trainer: pl.Trainer, strategy: GPipeStrategy, when: str) -> None:
        if not (self.pictures and trainer.is_global_zero) or self._timeline is None:
            return
        first = self.output_dir / "timeline_first.png"
        if when == "last" and self._pictured_at == self._reports and first.exists():
            path = self.output_dir / "timeline_last.png"  # one step only: the same picture, not drawn twice
            shutil.copyfile(first, path)
            self._log_picture(trainer, path, when)
            return
        self._pictured_at = self._reports
        d = int(getattr(strategy, "data_parallel_size", 1) or 1)
        title = (f"K={strategy.num_stages} M={strategy.chunks} D={d} {strategy.schedule} "
                 f"transport={strategy.transport} ({when} step{', replica 0' if d > 1 else ''})")
        predicted = predicted_timeline(self._timeline, strategy.schedule, strategy.chunks, strategy.checkpoint)
        path = save_timeline_figure(self._timeline, self.output_dir / f"timeline_{when}.png", title, predicted)
        self._log_picture(trainer, path, when)

    def _log_picture(self, trainer: pl.Trainer, path: Path, when: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image("pipeline/timeline", [str(path)], step=trainer.global_step, caption=[when])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        if strategy is not None and self._timeline is not None:
            self._picture(trainer, strategy, "last")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_validated_step = trainer.global_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write_summary(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Ctrl-C: the run so far still gets its summary (``"interrupted": true``) and last picture."""
        if not isinstance(exception, KeyboardInterrupt):
            return
        strategy = self._strategy(trainer)
        if strategy is not None and self._timeline is not None:
            self._picture(trainer, strategy, "last")
        self.extra_summary["interrupted"] = True
        self.write_summary(trainer)

    def write_summary(self, trainer: pl.Trainer) -> None:
        """Build the summary; on global rank 0 write ``summary.json`` and send it to wandb."""
        self.summary = self.build_summary(trainer)
        self._write(trainer)

    def add_to_summary(self, trainer: pl.Trainer, values: dict[str, Any]) -> None:
        """Add ``values`` (e.g. the test metrics) to the summary as it stands (kept in a later
        ``write_summary``) and write it again."""
        self.extra_summary.update(values)
        self.summary.update(values)
        self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    row = {k: v for k, v in self.summary.items() if isinstance(v, (int, float, str))}
                    logger.log_table("summary/table", columns=list(row), data=[list(row.values())])
                    logger.experiment.summary.update(row)

    def build_summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The numbers an experiment table needs (see the module docstring)."""
        strategy = self._strategy(trainer)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        if strategy is not None and strategy.last_loss is not None:
            metrics["train/loss"] = float(strategy.last_loss)
        val_key = next((k for k in ("val/acc", "val/bleu") if k in metrics), None)
        optimizers = trainer.optimizers
        summary: dict[str, Any] = {
            "run_name": self.output_dir.name,
            "run_dir": self.output_dir.name,
            **self.extra_summary,
            "optimizer": type(optimizers[0]).__name__.lower() if optimizers else None,
            "lr": optimizers[0].param_groups[0]["lr"] if optimizers else None,
            "overrides": self.overrides,
            "steps": trainer.global_step,
            "final_train_loss": metrics.get("train/loss"),
            "validation_metric": val_key,
            "validation_value": metrics.get(val_key) if val_key else None,
            "val_loss": metrics.get("val/loss"),
            "fit_seconds": time.perf_counter() - self._fit_start if self._fit_start else None,  # None: no fit
        }
        if strategy is not None:
            k, m = strategy.num_stages, strategy.chunks
            memory = self._memory
            summary.update({
                "K": k, "M": m, "D": int(getattr(strategy, "data_parallel_size", 1) or 1),
                "schedule": strategy.schedule, "checkpoint": strategy.checkpoint,
                "transport": strategy.transport,
                "balance": list(getattr(strategy.pipe, "balance", []) or []),
                "virtual_stages": getattr(getattr(strategy.pipe, "options", None), "virtual_stages", 1),
                "threads_per_stage": getattr(strategy.pipe, "threads_per_stage", None),
                "samples_per_s": mean(r[0] for r in self._rates) if self._rates else None,
                "tokens_per_s": mean(float(r[1]) for r in self._rates) if self._rates else None,
                "bubble_measured": mean(self._bubbles) if self._bubbles else None,
                "bubble_measured_over": (f"mean over {len(self._bubbles)} step(s); each epoch's first "
                                         "batch is left out as warm-up (unless max_steps=1)"),
                "bubble_theory": self._theory(strategy),
                "stage_busy_s": [mean(col) for col in zip(*self._busy)] if self._busy else [],
                "stage_parameter_bytes": [s["parameter_bytes"] for s in memory],
                "stage_peak_activation_bytes": [s["peak_activation_bytes"] for s in memory],
            })
        summary.update({new: summary.get(old) for old, new in ALIASES.items() if old in summary})
        if self.derived is not None:
            summary.update(self.derived(summary, self.step_walls))
        return summary

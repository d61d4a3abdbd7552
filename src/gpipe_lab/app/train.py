"""The Hydra app ``gpipe-train`` (also ``python -m gpipe_lab.app.train``).

    gpipe-train                                   # the default: AmoebaNet-D tiny, K=2, M=4, CPU
    gpipe-train -m pipeline.partitions=1,2 pipeline.chunks=1,4,8
    gpipe-train experiment=transformer_tiny logger=csv
    gpipe-train ckpt_path=/path/to/run/checkpoints/last.ckpt pipeline.partitions=4   # resume, another K
    gpipe-train ckpt_path=last                    # resume the newest run's last.ckpt
    gpipe-train experiment=transfer_synthetic init_from=/path/to/last.ckpt   # fine-tune
    gpipe-train mode=test ckpt_path=/path/to/last.ckpt   # evaluate a checkpoint on the test set (gpipe_lab.app.evaluation)
    gpipe-train pipeline.plan=auto pipeline.memory_per_device=8MiB   # the planner chooses K, M, ... (plan_run)

Every run writes ``summary.json`` (with the test metrics when the data has a test split),
``timeline_{first,last}.png``, ``checkpoints/last.ckpt``
(every ``callbacks.checkpoint_every_n_steps`` steps, at the end and on Ctrl-C) and (by
default) an offline wandb run under its output directory. ``gpipe_lab.app.config.check_config`` checks the
whole config first, once (the dry run and each job of a sweep make the same call).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, ListConfig, OmegaConf

from gpipe_lab.app.config import CheckedConfig, ConfigError, check_config  # registers the generated nodes
from gpipe_lab.app.config.environment import model_overrides
from gpipe_lab.app.config.groups import trainer_devices
from gpipe_lab.app.config.schema import CONFIG_DIR as CONFIG_PATH
from gpipe_lab.app.config.schema import CallbacksConfig, resolved_dict
from gpipe_lab.app.continuation import continue_run
from gpipe_lab.app.evaluation import check_test_set, evaluate_checkpoint, evaluates, final_test
from gpipe_lab.app.plan_run import choose_plan
from gpipe_lab.app.run_console import (
    CompileNotice,
    ProgressBar,
    ValidateAtTheEnd,
    close_progress_bars,
    discard_run_dir,
    global_rank,
    print_lightning_logs_once,
    record_failure,
    stage_summary,
    summary_line,
    tell_interrupted,
)
from gpipe_lab.app.run_start import fetch_data, load_weights, saved_config_path
from gpipe_lab.app.suggest import suggest_overrides
from gpipe_lab.app.sweep_check import job_overrides, job_sweep_values
from gpipe_lab.app.torchrun_dir import publish_run_dir, rank_overrides
from gpipe_lab.app.wandb_run import build_wandb_logger, job_run_name
from gpipe_lab.bench.provenance import source_commit
from gpipe_lab.data import build_datamodule as build_named_datamodule
from gpipe_lab.data.checks import DataNotFoundError
from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.lightning.callbacks import PipelineMetrics
from gpipe_lab.lightning.known_warnings import silence_known_warnings
from gpipe_lab.lightning.resume import BestCheckpoint, ResumableCheckpoint, resumed_options
from gpipe_lab.models import build
from gpipe_lab.pipeline.distributed.failure import PeerFailedError
from gpipe_lab.pipeline.measuring.costs import AUTO, AUTO_MEASURED
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.planner.preset_costs import preset_costs

__all__ = ["CONFIG_DIR", "build_datamodule", "build_logger", "build_module", "cli", "engine_options",
           "main", "model_overrides", "run"]

#: the YAML configs' folder, as Hydra takes it (``app.config.schema.CONFIG_DIR``)
CONFIG_DIR = str(CONFIG_PATH)


def build_datamodule(cfg: DictConfig) -> Any:
    """The ``data`` group's datamodule."""
    kwargs = {k: v for k, v in resolved_dict(cfg.data).items() if k != "name"}
    return build_named_datamodule(cfg.data.name, seed=cfg.seed, **kwargs)


def model_sizes(cfg: DictConfig, datamodule: Any) -> dict[str, Any]:
    """The ``models.build`` overrides of the run: the ``model`` group's, with the class count /
    vocabulary size the datamodule knows."""
    overrides = model_overrides(cfg)
    for key in ("num_classes", "vocab_size"):
        if key in overrides and getattr(datamodule, key, None):
            overrides[key] = int(getattr(datamodule, key))
    return overrides


def build_module(cfg: DictConfig, datamodule: Any) -> Any:
    """``model.task``'s LightningModule (``hydra.utils.instantiate``) around ``models.build``'s layers,
    trained with the ``optimizer`` group's optimizer.

    The datamodule decides the class count / vocabulary size when it knows them.
    """
    layers = build(cfg.model.name, **model_sizes(cfg, datamodule))
    return instantiate(cfg.model.task, layers=layers, optimizer=instantiate(cfg.optimizer))


def build_callbacks(c: CallbacksConfig, output_dir: Path, trainer_kwargs: dict[str, Any]) -> list[Any]:
    """The checkpoint callbacks (the checked ``callbacks`` group: last and best) and the progress bar, as
    the trainer config asks."""
    callbacks: list[Any] = []
    if trainer_kwargs.get("enable_checkpointing", True):
        callbacks.append(ResumableCheckpoint(output_dir / "checkpoints", every_n_train_steps=c.checkpoint_every_n_steps,
                                             save_top_k=c.keep_checkpoints, handle_sigint=c.graceful_ctrl_c))
        if c.model_checkpoint.monitor is not None:
            callbacks.append(BestCheckpoint(output_dir / "checkpoints", c.model_checkpoint.monitor,
                                            c.model_checkpoint.mode))
    if trainer_kwargs.get("enable_progress_bar", True):
        callbacks.append(ProgressBar(refresh_rate=1))
    return callbacks


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's config with every interpolation resolved (Hydra's own node left out)."""
    # node by node: Hydra's own node is not resolved (its ${hydra:...} need a running app)
    return {str(k): OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
            for k, v in cfg.items() if k != "hydra"}


def build_logger(checked: CheckedConfig, output_dir: Path, options: PipelineOptions | None = None) -> Any:
    """The ``logger`` group's logger (``False`` for ``none``); wandb runs are grouped and named
    by ``gpipe_lab.app.wandb_run`` (after ``options``, default the checked ones)."""
    cfg = checked.cfg
    name = cfg.logger.name if cfg.get("logger") else "none"
    if name == "csv":
        return CSVLogger(save_dir=str(output_dir), name="csv")
    if name == "wandb":
        continued = None if evaluates(cfg) else checked.ckpt_path
        return build_wandb_logger(cfg, output_dir, options or checked.options, resolved_config(cfg),
                                  ckpt_path=continued)  # an evaluated checkpoint's wandb run is left as it is
    return False


def engine_options(cfg: DictConfig, options: PipelineOptions, module: Any) -> PipelineOptions:
    """The validated options as the engine takes them: measured per-layer costs, the run's seed."""
    changes: dict[str, Any] = {}
    # the app always has a sample (the preset's), so "auto" is what the engine measures given one
    kind = AUTO_MEASURED if options.cost == AUTO else options.cost
    if isinstance(kind, str) and kind != "params":
        size = 1  # FLOPs and bytes per sample do not depend on the batch; time per sample does
        if kind == "time":
            batch = cfg.data.get("batch_size") or 2 * options.chunks  # token-budget batching: no fixed size
            size = max(1, batch // options.chunks)
        changes["cost"] = preset_costs(module.layers, kind, batch_size=size)
    if options.seed is None:
        changes["seed"] = int(cfg.seed)
    return options.replace(**changes)


def output_dir_of(cfg: DictConfig) -> Path:
    try:
        return Path(cfg.paths.output_dir)
    except Exception:  # noqa: BLE001 - outside a Hydra run (tests): no ${hydra:...}
        return Path(cfg.paths.log_dir) / cfg.task_name / "run"


def build_trainer(checked: CheckedConfig, options: PipelineOptions, module: Any, output_dir: Path,
                  metrics: PipelineMetrics) -> pl.Trainer:
    """The Lightning trainer: the ``trainer`` group, the GPipe strategy (``options``: the checked ones,
    as planned and resumed), the logger and callbacks."""
    cfg = checked.cfg
    trainer_kwargs = resolved_dict(cfg.trainer)
    trainer_kwargs["devices"] = trainer_devices(cfg, options)
    # Lightning's summary shows one ``layers | Sequential`` row and 0 FLOPs; ``stage_summary`` replaces it.
    trainer_kwargs.setdefault("enable_model_summary", False)
    callbacks: list[Any] = [metrics, ValidateAtTheEnd(), *build_callbacks(checked.callbacks, output_dir, trainer_kwargs)]
    if options.compile:
        callbacks.append(CompileNotice())
    strategy = GPipeStrategy(options=engine_options(cfg, options, module))
    if global_rank() == 0 and trainer_kwargs.get("enable_model_summary") is False:
        print(stage_summary(strategy.options, module.layers))
    return pl.Trainer(**trainer_kwargs, strategy=strategy, logger=build_logger(checked, output_dir, options),
                      callbacks=callbacks, default_root_dir=str(output_dir))


def fit(cfg: DictConfig, trainer: pl.Trainer, module: Any, datamodule: Any, metrics: PipelineMetrics,
        ckpt_path: str | None) -> None:
    """Train (resuming ``ckpt_path``), then validate the final model when the last validation was
    earlier and test it (``gpipe_lab.app.evaluation``); or with ``mode=validate|test`` evaluate
    ``ckpt_path`` only. The wandb run is closed whatever happens."""
    try:
        try:
            if evaluates(cfg):
                assert ckpt_path is not None  # validate_mode
                evaluate_checkpoint(cfg.mode, trainer, module, datamodule, metrics, ckpt_path)
                return
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
            if metrics.last_validated_step != trainer.global_step and trainer.limit_val_batches:
                trainer.validate(module, datamodule=datamodule, verbose=False)  # the final model's metric
                metrics.write_summary(trainer)
            final_test(trainer, module, datamodule, metrics)
        finally:
            if cfg.logger.get("name") == "wandb":  # import cost: only a wandb-logged run loads wandb
                from gpipe_lab.app.wandb_run import finish_and_flush

                finish_and_flush()
    except SystemExit:  # Lightning's answer to Ctrl-C: exit(1) once the interrupted state is saved
        if trainer.interrupted and trainer.is_global_zero:
            close_progress_bars(trainer)
            tell_interrupted(metrics, output_dir_of(cfg))
        raise
    except Exception as exc:
        close_progress_bars(trainer)
        record_failure(metrics, trainer, output_dir_of(cfg), exc)
        raise


def run(cfg: DictConfig) -> dict[str, Any]:
    """Check the whole config (``check_config``, once), build and fit; returns the run's summary
    (empty for a dry run).

    Raises:
        ConfigError: a config that cannot run (before anything is built or logged).
    """
    silence_known_warnings()
    print_lightning_logs_once()
    output_dir = output_dir_of(cfg)
    cfg = continue_run(cfg)  # ckpt_path: the checkpoint's run's overrides, wandb run and a link to it
    checked = check_config(cfg, output_dir)
    if cfg.get("dry_run"):
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return {}
    if saved_config_path() is not None:
        print(f"config: {saved_config_path()} (composed; the command's overrides in overrides.yaml beside it)")
    options, ckpt_path = checked.options, checked.ckpt_path
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(cfg)
    fetch_data(cfg, datamodule)
    check_test_set(cfg, datamodule)
    module = build_module(cfg, datamodule)
    init_from = load_weights(cfg, module, ckpt_path)
    plan = None
    if checked.planner.auto:
        options, plan = choose_plan(cfg, options, checked.planner, model_sizes(cfg, datamodule))
    extra = {"model": cfg.model.name, "data": cfg.data.name, "batch_size": cfg.data.get("batch_size"),
             "seed": cfg.seed, "precision": str(cfg.trainer.get("precision")), "mode": cfg.get("mode", "train"),
             "evaluated" if evaluates(cfg) else "resumed_from": ckpt_path,
             "init_from": init_from, "run_name": job_run_name(options), "swept": job_sweep_values(),
             "commit": source_commit()}
    if plan is not None:
        extra.update(plan.summary())
    metrics = PipelineMetrics(output_dir, extra_summary=extra, derived=plan.compare if plan is not None else None,
                              overrides=job_overrides(), pictures=checked.callbacks.timeline_pictures)
    options = resumed_options(options, ckpt_path)  # the run's thread count: a bitwise continuation
    trainer = build_trainer(checked, options, module, output_dir, metrics)
    fit(cfg, trainer, module, datamodule, metrics, ckpt_path)
    if trainer.is_global_zero:
        print(summary_line(metrics.summary, output_dir))
    return metrics.summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    """The Hydra app (the console script ``gpipe-train`` is ``cli``); returns the validation metric
    (for sweepers).

    Raises:
        SystemExit: one line for a config error or a missing dataset (no traceback).
    """
    publish_run_dir(HydraConfig.get().runtime.output_dir)  # torchrun: the other ranks write here too
    try:
        summary = run(cfg)
    except ConfigError as exc:
        discard_run_dir()
        if os.environ.get("RANK", "0") != "0":  # every rank has the same config: rank 0 says it once
            raise SystemExit(1) from None
        raise SystemExit(f"config error: {exc}") from None
    except DataNotFoundError as exc:  # a path to fix, not a bug: no traceback
        discard_run_dir()
        raise SystemExit(f"data error: {exc}") from None
    except PeerFailedError as exc:
        if "KeyboardInterrupt" not in str(exc):
            discard_run_dir(failed=True)
            raise
        raise SystemExit(f"stopped: {str(exc).splitlines()[0]}") from None  # Ctrl-C on another rank
    except Exception:
        discard_run_dir(failed=True)  # kept only with a checkpoint or a log (and then its summary.json)
        raise
    if cfg.get("dry_run"):
        discard_run_dir()
    value = summary.get("validation_value")
    return float(value) if value is not None else None


def cli() -> None:
    """``gpipe-train``: the Hydra app, after ``did you mean`` hints for overrides naming no key or
    option (which Hydra would reject with a longer message that suggests the wrong fix).

    Raises:
        SystemExit: status 1 with the hints, else the app's exit status, as Hydra and ``main`` give it.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started with `&` from a script, SIGINT arrives ignored and Ctrl-C (or kill -INT) would
        # not stop the run, on any rank; Ctrl-C is how a run is stopped and saved.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    hints = suggest_overrides(CONFIG_DIR, sys.argv[1:])
    if hints:
        raise SystemExit("\n".join(hints))
    sys.argv += rank_overrides(sys.argv[1:])  # torchrun: ranks other than 0 run in rank 0's folder
    main()


if __name__ == "__main__":
    cli()

"""The Hydra app ``gpipe-train`` (also ``python -m gpipe_lab.train``).

    gpipe-train                                   # the default: AmoebaNet-D tiny, K=2, M=4, CPU
    gpipe-train -m pipeline.partitions=1,2 pipeline.chunks=1,4,8
    gpipe-train experiment=transformer_tiny logger=csv
    gpipe-train ckpt_path=/path/to/run/checkpoints/last.ckpt pipeline.partitions=4   # resume, another K
    gpipe-train ckpt_path=last                    # resume the newest run's last.ckpt
    gpipe-train experiment=transfer_synthetic init_from=/path/to/last.ckpt   # fine-tune

Every run writes ``summary.json``, ``timeline_{first,last}.png``, ``checkpoints/last.ckpt``
(every ``callbacks.checkpoint_every_n_steps`` steps, at the end and on Ctrl-C) and (by
default) an offline wandb run under its output directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

import gpipe_lab.config_schema  # noqa: F401  (registers the generated config nodes)
from gpipe_lab.pipeline.options import PipelineOptions

# The YAML ships inside the package (``gpipe_lab/conf``; in a checkout a link to the top-level
# ``conf/``), so an installed wheel finds it too.
CONFIG_DIR = str(Path(os.environ.get("GPIPE_LAB_CONF", Path(__file__).resolve().parent / "conf")))


def build_datamodule(cfg: DictConfig) -> Any:
    from gpipe_lab.data import build_datamodule as build

    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "name"}
    return build(cfg.data.name, seed=cfg.seed, **kwargs)


def model_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The ``model`` group's ``gpipe_lab.models.build`` overrides (all but ``name`` and ``task``)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    return {k: v for k, v in model.items() if k not in ("name", "task")}  # type: ignore[union-attr]


def build_module(cfg: DictConfig, datamodule: Any) -> Any:
    """``model.task``'s LightningModule (``hydra.utils.instantiate``) around ``models.build``'s layers,
    trained with the ``optimizer`` group's optimizer.

    The datamodule decides the class count / vocabulary size when it knows them.
    """
    from hydra.utils import instantiate

    from gpipe_lab.models import build

    overrides = model_overrides(cfg)
    for key in ("num_classes", "vocab_size"):
        if key in overrides and getattr(datamodule, key, None):
            overrides[key] = int(getattr(datamodule, key))
    layers = build(cfg.model.name, **overrides)
    return instantiate(cfg.model.task, layers=layers, optimizer=instantiate(cfg.optimizer))


def init_from_of(cfg: DictConfig) -> str | None:
    """The checkpoint whose weights start a new run: ``init_from``, else (when not resuming)
    an experiment's ``transfer.checkpoint``."""
    if cfg.get("init_from") is not None:
        return str(cfg.init_from)
    transfer = cfg.get("transfer")
    if cfg.get("ckpt_path") is None and transfer is not None and transfer.get("checkpoint") is not None:
        return str(transfer.checkpoint)
    return None


def build_callbacks(cfg: DictConfig, output_dir: Path, trainer_kwargs: dict[str, Any]) -> list[Any]:
    """The checkpoint callback (``callbacks`` group) and the progress bar, as the trainer config asks."""
    callbacks: list[Any] = []
    if trainer_kwargs.get("enable_checkpointing", True):
        from gpipe_lab.config import validate_callbacks
        from gpipe_lab.lightning.resume import ResumableCheckpoint

        c = validate_callbacks(cfg)
        callbacks.append(ResumableCheckpoint(output_dir / "checkpoints", every_n_train_steps=c.checkpoint_every_n_steps,
                                             save_top_k=c.keep_checkpoints, handle_sigint=c.graceful_ctrl_c))
    if trainer_kwargs.get("enable_progress_bar", True):
        from lightning.pytorch.callbacks import TQDMProgressBar

        callbacks.append(TQDMProgressBar(refresh_rate=1))
    return callbacks


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's config with every interpolation resolved (Hydra's own node left out)."""
    return {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
            for k, v in cfg.items() if k != "hydra"}


def build_logger(cfg: DictConfig, output_dir: Path, options: PipelineOptions | None = None) -> Any:
    """The ``logger`` group's logger (``False`` for ``none``); wandb runs are grouped and named
    by ``gpipe_lab.lightning.wandb_run``."""
    name = cfg.logger.name if cfg.get("logger") else "none"
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(output_dir), name="csv")
    if name == "wandb":
        from gpipe_lab.config import validate_pipeline
        from gpipe_lab.lightning.wandb_run import build_wandb_logger

        return build_wandb_logger(cfg, output_dir, options or validate_pipeline(cfg), resolved_config(cfg))
    return False


def engine_options(cfg: DictConfig, options: PipelineOptions, module: Any) -> PipelineOptions:
    """The validated options as the engine takes them: measured per-layer costs, the run's seed."""
    changes: dict[str, Any] = {}
    if isinstance(options.cost, str) and options.cost != "params":
        from gpipe_lab.models import layer_costs

        changes["cost"] = layer_costs(module.layers, options.cost)
    if options.seed is None:
        changes["seed"] = int(cfg.seed)
    return options.replace(**changes)


def output_dir_of(cfg: DictConfig) -> Path:
    try:
        return Path(cfg.paths.output_dir)
    except Exception:  # noqa: BLE001 - outside a Hydra run (tests): no ${hydra:...}
        return Path(cfg.paths.log_dir) / cfg.task_name / "run"


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate, build and fit; returns the run's summary.

    Raises:
        ConfigError: a config that cannot run (before anything is built).
    """
    import lightning.pytorch as pl

    from gpipe_lab.config import trainer_devices, validate, validate_layer_count
    from gpipe_lab.continuation import continue_run
    from gpipe_lab.lightning import GPipeStrategy
    from gpipe_lab.lightning.callbacks import PipelineMetrics
    from gpipe_lab.lightning.known_warnings import silence_known_warnings
    from gpipe_lab.lightning.wandb_run import run_name

    silence_known_warnings()
    print_lightning_logs_once()
    cfg = continue_run(cfg)  # ckpt_path: the checkpoint's run's overrides, wandb run and a link to it
    options = validate(cfg)
    if cfg.get("dry_run"):
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return {}
    output_dir = output_dir_of(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(cfg)
    module = build_module(cfg, datamodule)
    validate_layer_count(cfg, options, len(module.layers))
    ckpt_path = None
    if cfg.get("ckpt_path") is not None:
        from gpipe_lab.lightning.resume import resolve_ckpt_path

        ckpt_path = resolve_ckpt_path(cfg.ckpt_path, output_dir, Path(cfg.paths.log_dir) / cfg.task_name / "runs")
        from gpipe_lab.lightning.resume_checks import check_resume

        check_resume(ckpt_path, cfg, module)
    init_from = init_from_of(cfg)
    if init_from is not None:
        from gpipe_lab.lightning.resume import load_initial_weights

        fresh = load_initial_weights(module, init_from, fresh_classifier=bool(cfg.get("fresh_classifier", True)))
        print(f"init_from {init_from}: loaded every weight but {len(fresh)} new one(s) "
              f"{fresh[:4]}{' ...' if len(fresh) > 4 else ''}")
    strategy = GPipeStrategy(options=engine_options(cfg, options, module))
    logger = build_logger(cfg, output_dir, options)
    extra = {"model": cfg.model.name, "data": cfg.data.name, "batch_size": cfg.data.get("batch_size"),
             "seed": cfg.seed, "precision": str(cfg.trainer.get("precision")), "resumed_from": ckpt_path,
             "init_from": init_from, "run_name": run_name(options)}
    metrics = PipelineMetrics(output_dir, extra_summary=extra)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_kwargs["devices"] = trainer_devices(cfg, options)  # type: ignore[index]
    callbacks: list[Any] = [metrics, *build_callbacks(cfg, output_dir, trainer_kwargs)]
    try:
        trainer = pl.Trainer(**trainer_kwargs, strategy=strategy, logger=logger, callbacks=callbacks,
                             default_root_dir=str(output_dir))
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        if metrics.last_validated_step != trainer.global_step and trainer.limit_val_batches:
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the final model's metric
            metrics.write_summary(trainer)
    finally:
        if cfg.logger.get("name") == "wandb":
            import wandb

            wandb.finish()
    if trainer.is_global_zero:
        value = metrics.summary.get("validation_value")
        print(f"summary: K={metrics.summary.get('K')} M={metrics.summary.get('M')} "
              f"train_loss={metrics.summary.get('final_train_loss')} "
              f"{metrics.summary.get('validation_metric')}={value} "
              f"samples/s={metrics.summary.get('samples_per_s')} -> {output_dir / 'summary.json'}")
    return metrics.summary


def print_lightning_logs_once() -> None:
    """Lightning's loggers print through Hydra's handlers only.

    Lightning gives its ``lightning`` logger a console handler of its own when it is
    imported before logging is set up (here: by a Hydra callback), so each INFO line
    would print twice, once in each format.
    """
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    """The Hydra app (the console script ``gpipe-train`` is ``cli``); returns the validation metric
    (for sweepers).

    Raises:
        SystemExit: one line for a config error or a missing dataset (no traceback).
    """
    from gpipe_lab.config import ConfigError
    from gpipe_lab.data.checks import DataNotFoundError

    try:
        summary = run(cfg)
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None
    except DataNotFoundError as exc:  # a path to fix, not a bug: no traceback
        raise SystemExit(f"data error: {exc}") from None
    value = summary.get("validation_value")
    return float(value) if value is not None else None


def cli() -> None:
    """``gpipe-train``: the Hydra app, plus ``did you mean`` hints when Hydra rejects an override.

    Raises:
        SystemExit: the app's exit status, as Hydra and ``main`` give it.
    """
    import sys

    try:
        main()
    except SystemExit as exc:
        if exc.code == 1:  # Hydra rejected the command line (the app's own errors exit with a message)
            from gpipe_lab.suggest import suggest_overrides

            for hint in suggest_overrides(CONFIG_DIR, sys.argv[1:]):
                print(hint, file=sys.stderr)
        raise


if __name__ == "__main__":
    cli()

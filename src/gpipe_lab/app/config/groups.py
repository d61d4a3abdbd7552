"""The config's own checks: keys, values and combinations of its groups, with nothing built or read.

``validate(cfg)`` raises ``ConfigError`` naming the offending key for:

- an unknown key in a group (``pipeline``, ``trainer``, ``logger``, ``optimizer``, ``callbacks``;
  ``model`` against ``gpipe_lab.models.build``'s overrides; ``data`` against the datamodule's arguments);
- a bad value (wrong type, unknown mode / schedule / nonfinite policy / name, non-positive sizes);
- an impossible combination (partitions > layers, balance not summing to the layers,
  chunks > data.batch_size, distributed world size not divisible by K, local GPU stages
  without enough devices).

It is the first section of ``gpipe_lab.app.config.check_config``, which a run calls once.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, replace
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from gpipe_lab.app.config.mistakes import validate_model_data, validate_trainer_values, validate_transfer
from gpipe_lab.app.config.planner import PlannerConfig, engine_section, validate_planner
from gpipe_lab.app.config.schema import (  # also registers the generated nodes
    CallbacksConfig,
    ConfigError,
    LoggerConfig,
    check_positive,
)
from gpipe_lab.pipeline.distributed.topology import check_world
from gpipe_lab.pipeline.options import OptionError, PipelineOptions
from gpipe_lab.pipeline.partitioning.partition import check_layer_count

LOGGERS = ("wandb", "csv", "none")
WANDB_MODES = ("online", "offline", "disabled")
MODES = ("train", "validate", "test")


#: Root blocks read by experiment scripts (e.g. ``experiments/transfer.py``), ignored by gpipe-train.
EXTENSION_KEYS = ("transfer",)


@dataclass(frozen=True)
class CheckedConfig:
    """A config that passed the checks, with what they read from it.

    ``validate`` fills the groups' part; ``check_config`` adds what it found on this machine
    (``ckpt_path``, ``num_layers``).
    """

    #: the composed config, as checked
    cfg: DictConfig
    #: the ``pipeline`` group as the engine's options
    options: PipelineOptions
    #: the ``pipeline`` group's planner keys
    planner: PlannerConfig
    #: the ``callbacks`` group over its defaults (a ``CallbacksConfig``)
    callbacks: CallbacksConfig
    #: the checkpoint to resume or evaluate, as an existing file (``None``: none, or not resolved yet)
    ckpt_path: str | None = None
    #: the model's layer count (``None``: not built yet)
    num_layers: int | None = None


def _typed(section: Any, schema: type, key: str) -> DictConfig:
    """Merge ``section`` onto the dataclass ``schema``: unknown keys and bad types raise."""
    try:
        return cast(DictConfig, OmegaConf.merge(OmegaConf.structured(schema), section))
    except OmegaConfBaseException as exc:
        bad = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
        message = str(exc.msg if hasattr(exc, "msg") else exc).splitlines()[0]
        if isinstance(exc, ConfigKeyError):
            message += f"; allowed: {', '.join(f.name for f in fields(schema))}"
        raise ConfigError(f"{key}.{bad}: {message}") from None


def _check_keys(section: Any, allowed: list[str], key: str, what: str) -> None:
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        guess = f"did you mean {key + '.' if key else ''}{close[0]}? " if close else ""
        raise ConfigError(f"{key + '.' if key else ''}{unknown[0]}: unknown key for {what}; {guess}"
                          f"allowed: {', '.join(sorted(allowed))}")


def validate_pipeline(cfg: DictConfig) -> PipelineOptions:
    """The ``pipeline`` group as ``PipelineOptions``, every option checked once (the planner's keys,
    ``gpipe_lab.app.config.planner``, are the app's and left out).

    Raises:
        ConfigError: an unknown key, a wrong type or a bad value, naming ``pipeline.<key>``.
    """
    typed = _typed(engine_section(cfg.pipeline), PipelineOptions, "pipeline")
    options = cast(PipelineOptions, OmegaConf.to_object(typed))
    try:
        options.check(prefix="pipeline.")
    except OptionError as exc:
        raise ConfigError(str(exc)) from None
    from gpipe_lab.pipeline.measuring.costs import AUTO, COST_KINDS

    if isinstance(options.cost, str) and options.cost not in (AUTO, *COST_KINDS):
        raise ConfigError(f"pipeline.cost: must be one of {[AUTO, *COST_KINDS]} or a list of per-layer costs, "
                          f"got {options.cost!r}")
    return options


def validate_mode(cfg: DictConfig) -> str:
    """The run's ``mode`` (``gpipe_lab.app.evaluation``).

    Raises:
        ConfigError: an unknown mode, or ``validate`` / ``test`` without a checkpoint to evaluate.
    """
    mode = cfg.get("mode", "train")
    if mode not in MODES:
        raise ConfigError(f"mode: must be one of {list(MODES)}, got {mode!r}")
    if mode != "train" and cfg.get("ckpt_path") is None:
        raise ConfigError(f"mode={mode}: give the checkpoint to evaluate, ckpt_path=<run dir>/checkpoints/last.ckpt "
                          f"(or ckpt_path=last, the newest run's)")
    return str(mode)


def validate_model(cfg: DictConfig) -> None:
    from gpipe_lab.models import PRESETS
    from gpipe_lab.models.preset_registry import AMOEBANET_OVERRIDES, AMOEBANET_PRESETS, TRANSFORMER_OVERRIDES

    name = cfg.model.get("name")
    if name not in PRESETS:
        raise ConfigError(f"model.name: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    allowed = AMOEBANET_OVERRIDES if name in AMOEBANET_PRESETS else TRANSFORMER_OVERRIDES
    _check_keys(cfg.model, ["name", "task", *allowed], "model", f"preset {name!r}")
    task = cfg.model.get("task")
    if not isinstance(task, DictConfig) or not isinstance(task.get("_target_"), str):
        raise ConfigError(f"model.task: must be a node with the _target_ of the model's LightningModule "
                          f"(e.g. gpipe_lab.lightning.modules.ImageClassifier), got {task!r}")


def validate_data(cfg: DictConfig) -> None:
    from gpipe_lab.data import DATAMODULES
    from gpipe_lab.data.datamodule_registry import accepted_arguments

    name = cfg.data.get("name")
    if name not in DATAMODULES:
        raise ConfigError(f"data.name: unknown datamodule {name!r}; known: {', '.join(sorted(DATAMODULES))}")
    allowed = accepted_arguments(name)
    _check_keys(cfg.data, ["name", *allowed], "data", f"datamodule {name!r}")
    for key in ("batch_size", "num_train", "num_val", "tokens_per_batch"):
        check_positive(cfg.data.get(key), f"data.{key}")
    num_test = cfg.data.get("num_test")
    if num_test is not None and (not isinstance(num_test, int) or isinstance(num_test, bool) or num_test < 0):
        raise ConfigError(f"data.num_test: must be an integer >= 0 (0: no test split), got {num_test!r}")
    batch, num_train = cfg.data.get("batch_size"), cfg.data.get("num_train")
    drops_last = "drop_last" in allowed and cfg.data.get("drop_last", True)
    if drops_last and isinstance(batch, int) and isinstance(num_train, int) and batch > num_train:
        raise ConfigError(f"data.batch_size: {batch} is larger than data.num_train {num_train}, so an epoch "
                          f"has no full batch to train on (drop_last); lower data.batch_size or raise data.num_train")


def validate_trainer(cfg: DictConfig) -> None:
    import lightning.pytorch as pl

    allowed = [p for p in inspect.signature(pl.Trainer).parameters
               if p not in ("strategy", "logger", "callbacks", "self")]
    _check_keys(cfg.trainer, allowed, "trainer", "lightning.pytorch.Trainer")
    max_steps = cfg.trainer.get("max_steps", -1)
    if not isinstance(max_steps, int) or (max_steps < 1 and max_steps != -1):
        raise ConfigError(f"trainer.max_steps: must be a positive integer or -1, got {max_steps!r}")


def validate_logger(cfg: DictConfig) -> None:
    name = cfg.logger.get("name") if cfg.get("logger") else "none"
    if name not in LOGGERS:
        raise ConfigError(f"logger.name: must be one of {list(LOGGERS)}, got {name!r}")
    if name == "wandb":
        lg = _typed(cfg.logger, LoggerConfig, "logger")
        if lg.mode not in WANDB_MODES:
            raise ConfigError(f"logger.mode: must be one of {list(WANDB_MODES)}, got {lg.mode!r}")
    else:
        _check_keys(cfg.logger, ["name"], "logger", f"logger {name!r}")


def validate_callbacks(cfg: DictConfig) -> CallbacksConfig:
    """The ``callbacks`` group (checkpoints and Ctrl-C, see ``gpipe_lab.lightning.resume``) over its defaults.

    Raises:
        ConfigError: an unknown key or a bad value (naming ``callbacks.<key>``), or both ``ckpt_path``
            and ``init_from``.
    """
    c = _typed(cfg.get("callbacks") or {}, CallbacksConfig, "callbacks")
    every = c.checkpoint_every_n_steps
    if every is not None and every < 0:
        raise ConfigError(f"callbacks.checkpoint_every_n_steps: must be >= 0 or null, got {every!r}")
    if c.keep_checkpoints < -1:
        raise ConfigError(f"callbacks.keep_checkpoints: must be >= -1 (-1: all), got {c.keep_checkpoints!r}")
    validate_monitor(cfg, c.model_checkpoint)
    if cfg.get("ckpt_path") is not None and cfg.get("init_from") is not None:
        raise ConfigError("init_from: give either ckpt_path (resume a run) or init_from (new run from its "
                          "weights), not both")
    return cast(CallbacksConfig, c)


def validate_monitor(cfg: DictConfig, best: Any) -> None:
    """``callbacks.model_checkpoint``: ``monitor`` is a metric the model's validation logs, ``mode`` max or min.

    Raises:
        ConfigError: naming the key, the value and the allowed ones.
    """
    if best.mode not in (None, "max", "min"):
        raise ConfigError(f"callbacks.model_checkpoint.mode: {best.mode!r} is not max, min or null (null: min for a "
                          f"loss, else max)")
    if best.monitor is None:
        return
    from hydra.utils import get_class

    try:
        logged = getattr(get_class(str(cfg.model.task._target_)), "VALIDATION_METRICS", None)
    except Exception:  # noqa: BLE001 - a task of the user's: its metrics are not known here
        return
    if logged is None:  # a task that does not list them
        return
    if best.monitor not in logged:
        raise ConfigError(f"callbacks.model_checkpoint.monitor: {best.monitor!r} is not logged by "
                          f"{cfg.model.name}'s validation; allowed: {', '.join(logged)} (or null: no best checkpoint)")


def validate_optimizer(cfg: DictConfig) -> None:
    """The ``optimizer`` group: ``hydra.utils.instantiate`` gives a factory of the named optimizer.

    Raises:
        ConfigError: a missing or foreign ``_target_``, an unknown key, a non-number ``lr`` or an
            unknown ``optimizer.name``.
    """
    from gpipe_lab.lightning.modules import OPTIMIZERS, make_optimizer

    section = cfg.optimizer
    target = f"{make_optimizer.__module__}.{make_optimizer.__name__}"
    if section.get("_target_") != target:
        raise ConfigError(f"optimizer._target_: must be {target!r}, got {section.get('_target_')!r}")
    allowed = [p for p in inspect.signature(make_optimizer).parameters if p != "params"]
    _check_keys(section, ["_target_", "_partial_", *allowed], "optimizer", target)
    if section.get("name") not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: must be one of {list(OPTIMIZERS)}, got {section.get('name')!r}")
    for key in ("lr", "momentum", "weight_decay"):
        value = section.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ConfigError(f"optimizer.{key}: must be a number >= 0, got {value!r}")


def trainer_devices(cfg: DictConfig, p: PipelineOptions) -> Any:
    """``trainer.devices`` as the Trainer takes it: ``auto`` under the distributed transport is
    K processes per node (one per stage; more replicas: set a multiple of K)."""
    devices = cfg.trainer.get("devices", "auto")
    if p.transport == "distributed" and devices == "auto":
        return p.num_stages
    return devices


def validate_layer_count(cfg: DictConfig, p: PipelineOptions, num_layers: int) -> None:
    """The pipeline against the built model's layer count.

    Raises:
        ConfigError: a balance that does not sum to the layers, or more stages than layers.
    """
    try:
        check_layer_count(p, num_layers, prefix="pipeline.", subject=f"model {cfg.model.name!r}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def validate_combinations(cfg: DictConfig, p: PipelineOptions) -> None:
    """Checks that need several groups.

    Raises:
        ConfigError: chunks above the batch size, a distributed world size that K does not
            divide, or fewer local GPUs than stages.
    """
    k = p.num_stages
    batch = cfg.data.get("batch_size")
    if batch is not None and p.chunks > batch:
        raise ConfigError(f"pipeline.chunks: {p.chunks} micro-batches is more than data.batch_size={batch}")
    devices = cfg.trainer.get("devices", 1)
    nodes = cfg.trainer.get("num_nodes", 1) or 1
    if p.transport == "distributed" and devices != "auto":
        if not isinstance(devices, int) or isinstance(devices, bool):
            raise ConfigError(f"trainer.devices: the distributed transport needs an integer or auto (K processes "
                              f"per node), got {devices!r}")
        try:
            check_world(devices * nodes, k, what=f"trainer.devices: world size {devices * nodes} (devices x num_nodes)",
                        stages="pipeline.partitions", fix=f"drop trainer.devices (it then follows K) or set "
                        f"trainer.devices={k} (or a multiple of {k})")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    elif cfg.trainer.get("accelerator") in ("gpu", "cuda") and isinstance(devices, int) and devices < k:
        raise ConfigError(f"trainer.devices: {devices} GPUs for {k} local pipeline stages; set trainer.devices={k}")


def validate(cfg: DictConfig, num_layers: int | None = None) -> CheckedConfig:
    """Validate the composed config's groups (see the module docstring); with ``num_layers``, the
    pipeline against the model's layer count too.

    Raises:
        ConfigError: naming the key, for unknown keys, bad values and impossible combinations.
    """
    for group in ("model", "data", "pipeline", "trainer", "optimizer"):
        if cfg.get(group) is None:
            raise ConfigError(f"{group}: missing config group")
    known_root = {"model", "data", "pipeline", "trainer", "optimizer", "logger", "paths", "task_name",
                  "tags", "seed", "ckpt_path", "init_from", "callbacks", "dry_run", "experiment", "hydra",
                  "notes", "fresh_classifier", "mode", *EXTENSION_KEYS}
    _check_keys(cfg, sorted(known_root), "", "the root config")
    if not isinstance(cfg.get("seed"), int):
        raise ConfigError(f"seed: must be an integer, got {cfg.get('seed')!r}")
    validate_mode(cfg)
    validate_model(cfg)
    validate_data(cfg)
    validate_model_data(cfg)
    options = validate_pipeline(cfg)
    planner = validate_planner(cfg)
    validate_trainer(cfg)
    validate_trainer_values(cfg)
    validate_optimizer(cfg)
    validate_logger(cfg)
    callbacks = validate_callbacks(cfg)
    validate_transfer(cfg)
    validate_combinations(cfg, options)
    checked = CheckedConfig(cfg, options, planner, callbacks)
    if num_layers is not None:
        validate_layer_count(cfg, options, num_layers)
        checked = replace(checked, num_layers=num_layers)
    return checked

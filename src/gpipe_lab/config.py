"""Typed schema of the Hydra config and the checks that run before any training.

``validate(cfg)`` raises ``ConfigError`` naming the offending key for:

- an unknown key in a group (``pipeline``, ``trainer``, ``logger``, ``optimizer``; ``model``
  against ``gpipe_lab.models.build``'s overrides; ``data`` against the datamodule's arguments);
- a bad value (wrong type, unknown mode / schedule / nonfinite policy / name, non-positive sizes);
- an impossible combination (partitions > layers, balance not summing to the layers,
  chunks > data.batch_size, distributed world size not divisible by K, local GPU stages
  without enough devices).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

LOGGERS = ("wandb", "csv", "none")
WANDB_MODES = ("online", "offline", "disabled")
TRANSPORTS = ("local", "distributed")


#: Root blocks read by experiment scripts (e.g. ``experiments/transfer.py``), ignored by gpipe-train.
EXTENSION_KEYS = ("transfer",)


class ConfigError(ValueError):
    """A config that cannot run; the message starts with the key."""


@dataclass
class PipelineConfig:
    partitions: int | None = 2
    balance: list[int] | None = None
    chunks: int = 4
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    transport: str = "local"
    deferred_batch_norm: bool = False
    cost: Any = "params"
    threads_per_stage: int | None = None
    timeout: float = 300.0
    nonfinite: str = "raise"
    compile: Any = False


@dataclass
class OptimizerConfig:
    name: str = "adam"
    lr: float = 0.002
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])


@dataclass
class CallbacksConfig:
    checkpoint_every_n_steps: int | None = 50
    keep_checkpoints: int = 1
    graceful_ctrl_c: bool = True


@dataclass
class LoggerConfig:
    name: str = "wandb"
    mode: str = "offline"
    project: str = "gpipe-lab"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


def _typed(section: Any, schema: type, key: str) -> DictConfig:
    """Merge ``section`` onto the dataclass ``schema``: unknown keys and bad types raise."""
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), section)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        bad = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
        raise ConfigError(f"{key}.{bad}: {exc.msg if hasattr(exc, 'msg') else exc}") from None


def _check_keys(section: Any, allowed: list[str], key: str, what: str) -> None:
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(f"{key + '.' if key else ''}{unknown[0]}: unknown key for {what}; allowed: {', '.join(sorted(allowed))}")


def _positive(value: Any, key: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{key}: must be a positive integer, got {value!r}")


def validate_pipeline(cfg: DictConfig) -> DictConfig:
    from gpipe_lab.pipeline import CHECKPOINT_MODES, NONFINITE_POLICIES, SCHEDULES

    p = _typed(cfg.pipeline, PipelineConfig, "pipeline")
    _positive(p.partitions, "pipeline.partitions")
    _positive(p.chunks, "pipeline.chunks")
    if p.checkpoint not in CHECKPOINT_MODES:
        raise ConfigError(f"pipeline.checkpoint: must be one of {list(CHECKPOINT_MODES)}, got {p.checkpoint!r}")
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule: must be one of {sorted(SCHEDULES)}, got {p.schedule!r}")
    if p.transport not in TRANSPORTS:
        raise ConfigError(f"pipeline.transport: must be one of {list(TRANSPORTS)}, got {p.transport!r}")
    if p.nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"pipeline.nonfinite: must be one of {list(NONFINITE_POLICIES)}, got {p.nonfinite!r}")
    from gpipe_lab.models import COST_KINDS

    if isinstance(p.cost, str) and p.cost not in COST_KINDS:
        raise ConfigError(f"pipeline.cost: must be one of {list(COST_KINDS)} or a list of per-layer costs, "
                          f"got {p.cost!r}")
    if p.balance is not None:
        for i, b in enumerate(p.balance):
            _positive(b, f"pipeline.balance[{i}]")
        if p.partitions is not None and p.partitions != len(p.balance):
            raise ConfigError(f"pipeline.balance: {list(p.balance)} has {len(p.balance)} entries but "
                              f"pipeline.partitions={p.partitions}; set pipeline.partitions=null or match them")
    from gpipe_lab.pipeline.compiling import compile_kwargs

    try:
        compile_kwargs(p.compile, "pipeline.compile")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return p


def validate_model(cfg: DictConfig) -> None:
    from gpipe_lab.models import PRESETS
    from gpipe_lab.models.registry import AMOEBANET_OVERRIDES, AMOEBANET_PRESETS, TRANSFORMER_OVERRIDES

    name = cfg.model.get("name")
    if name not in PRESETS:
        raise ConfigError(f"model.name: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    allowed = AMOEBANET_OVERRIDES if name in AMOEBANET_PRESETS else TRANSFORMER_OVERRIDES
    _check_keys(cfg.model, ["name", *allowed], "model", f"preset {name!r}")


def validate_data(cfg: DictConfig) -> None:
    from gpipe_lab.data import DATAMODULES

    name = cfg.data.get("name")
    if name not in DATAMODULES:
        raise ConfigError(f"data.name: unknown datamodule {name!r}; known: {', '.join(sorted(DATAMODULES))}")
    allowed = [p for p in inspect.signature(DATAMODULES[name]).parameters if p not in ("variant",)]
    _check_keys(cfg.data, ["name", *allowed], "data", f"datamodule {name!r}")
    for key in ("batch_size", "num_train", "num_val", "tokens_per_batch"):
        _positive(cfg.data.get(key), f"data.{key}")
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


def validate_callbacks(cfg: DictConfig) -> DictConfig:
    """The ``callbacks`` group (checkpoints and Ctrl-C, see ``gpipe_lab.lightning.resume``)."""
    c = _typed(cfg.get("callbacks") or {}, CallbacksConfig, "callbacks")
    every = c.checkpoint_every_n_steps
    if every is not None and every < 0:
        raise ConfigError(f"callbacks.checkpoint_every_n_steps: must be >= 0 or null, got {every!r}")
    if c.keep_checkpoints < -1:
        raise ConfigError(f"callbacks.keep_checkpoints: must be >= -1 (-1: all), got {c.keep_checkpoints!r}")
    if cfg.get("ckpt_path") is not None and cfg.get("init_from") is not None:
        raise ConfigError("init_from: give either ckpt_path (resume a run) or init_from (new run from its "
                          "weights), not both")
    return c


def validate_combinations(cfg: DictConfig, p: DictConfig, num_layers: int | None) -> None:
    """Checks that need several groups (and, when given, the model's layer count)."""
    k = len(p.balance) if p.balance is not None else p.partitions
    if num_layers is not None:
        if p.balance is not None and sum(p.balance) != num_layers:
            raise ConfigError(f"pipeline.balance: {list(p.balance)} sums to {sum(p.balance)} but model "
                              f"{cfg.model.name!r} has {num_layers} layers")
        if k > num_layers:
            raise ConfigError(f"pipeline.partitions: {k} partitions but model {cfg.model.name!r} has only "
                              f"{num_layers} layers")
    batch = cfg.data.get("batch_size")
    if batch is not None and p.chunks > batch:
        raise ConfigError(f"pipeline.chunks: {p.chunks} micro-batches is more than data.batch_size={batch}")
    devices = cfg.trainer.get("devices", 1)
    nodes = cfg.trainer.get("num_nodes", 1) or 1
    if p.transport == "distributed":
        if not isinstance(devices, int):
            raise ConfigError(f"trainer.devices: the distributed transport needs an integer, got {devices!r}")
        if (devices * nodes) % k:
            raise ConfigError(f"trainer.devices: world size {devices * nodes} (devices x num_nodes) is not "
                              f"divisible by pipeline.partitions={k}")
    elif cfg.trainer.get("accelerator") in ("gpu", "cuda") and isinstance(devices, int) and devices < k:
        raise ConfigError(f"trainer.devices: {devices} GPUs for {k} local pipeline stages; set trainer.devices={k}")


def validate(cfg: DictConfig, num_layers: int | None = None) -> DictConfig:
    """Validate the composed config (see the module docstring); returns the typed pipeline section.

    Raises:
        ConfigError: naming the key, for unknown keys, bad values and impossible combinations.
    """
    for group in ("model", "data", "pipeline", "trainer", "optimizer"):
        if cfg.get(group) is None:
            raise ConfigError(f"{group}: missing config group")
    known_root = {"model", "data", "pipeline", "trainer", "optimizer", "logger", "paths", "task_name",
                  "tags", "seed", "ckpt_path", "init_from", "callbacks", "dry_run", "experiment", "hydra",
                  "notes", *EXTENSION_KEYS}
    _check_keys(cfg, sorted(known_root), "", "the root config")
    if not isinstance(cfg.get("seed"), int):
        raise ConfigError(f"seed: must be an integer, got {cfg.get('seed')!r}")
    validate_model(cfg)
    validate_data(cfg)
    p = validate_pipeline(cfg)
    validate_trainer(cfg)
    _typed(cfg.optimizer, OptimizerConfig, "optimizer")
    from gpipe_lab.lightning.modules import OPTIMIZERS

    if cfg.optimizer.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: must be one of {list(OPTIMIZERS)}, got {cfg.optimizer.name!r}")
    validate_logger(cfg)
    validate_callbacks(cfg)
    validate_combinations(cfg, p, num_layers)
    return p

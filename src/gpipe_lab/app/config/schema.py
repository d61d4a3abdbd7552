"""The config's schema: nodes generated from the code's dataclasses (so each default is written
once) and the error type every config check raises.

Generated nodes, each a group's starting point (its YAML lists only its own choices over them):

- ``pipeline/schema``: every ``PipelineOptions`` field with its dataclass default
  (``conf/pipeline/default.yaml``);
- ``callbacks/schema``: ``CallbacksConfig`` (``conf/callbacks/default.yaml``);
- ``logger/wandb_schema``: ``LoggerConfig`` (``conf/logger/wandb.yaml``).

Importing this module registers them in Hydra's ``ConfigStore`` (``gpipe_lab.app.train`` and the
config package import it, so every compose sees them). The nodes are plain mappings, not typed
ones: values are checked by ``gpipe_lab.app.config.check_config``, whose errors name the key and
what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from gpipe_lab.pipeline.options import PipelineOptions

#: The YAML configs: shipped inside the package (``gpipe_lab/conf``; in a checkout a link to the
#: top-level ``conf/``), so an installed wheel finds them too; ``GPIPE_LAB_CONF`` points elsewhere.
CONFIG_DIR = Path(os.environ.get("GPIPE_LAB_CONF", Path(__file__).resolve().parents[2] / "conf"))


class ConfigError(ValueError):
    """A config that cannot run; the message starts with the key."""


def check_positive(value: Any, key: str) -> None:
    """Raises:
        ConfigError: ``value`` is set and not an integer >= 1 (naming ``key``).
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{key}: must be a positive integer, got {value!r}")


def resolved_dict(node: Any) -> dict[str, Any]:
    """A mapping of the config (a group, ``trainer``, ``model``, ...) resolved, as a plain dict.

    Raises:
        ConfigError: ``node`` is not a mapping.
    """
    values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if not isinstance(values, dict):
        raise ConfigError(f"expected a mapping of keys, got {values!r}")
    return {str(k): v for k, v in values.items()}


@dataclass
class ModelCheckpointConfig:
    """``best.ckpt`` beside ``last.ckpt``: the checkpoint of the best validation value of ``monitor``
    (for its weights: ``init_from``, ``gpipe-export``; resume from ``last.ckpt``)."""

    #: a metric of the model's validation, e.g. val/acc (images), val/bleu (translation), val/loss; null: no best.ckpt
    monitor: str | None = None
    #: max or min (null: min for a loss, else max)
    mode: str | None = None


@dataclass
class CallbacksConfig:
    """Checkpoints of gpipe-train, under ``<output_dir>/checkpoints`` (none with
    ``trainer.enable_checkpointing=false``).

    ``last.ckpt`` is always the newest, written at the end of a training step only: every N optimizer
    steps, at the final step, and on Ctrl-C. Resume with ``ckpt_path=<run dir>/checkpoints/last.ckpt``
    (or ``ckpt_path=last``): the run continues at the next batch with the same losses as an
    uninterrupted one (docs/reliability.md).
    """

    #: null or 0: only at the final step and on Ctrl-C
    checkpoint_every_n_steps: int | None = 50
    #: numbered copies epoch=E-step=S.ckpt kept (-1: all; 0: last.ckpt only); last.ckpt links the newest
    keep_checkpoints: int = 0
    #: 1st Ctrl-C: finish the step, write last.ckpt, exit 1; 2nd Ctrl-C: stop at once
    graceful_ctrl_c: bool = True
    #: draw the measured timeline of the first and the last step (timeline_first.png, timeline_last.png,
    #: and to wandb); false: none, e.g. for a sweep of many short jobs (a picture costs ~0.2 s on a CPU)
    timeline_pictures: bool = True
    model_checkpoint: ModelCheckpointConfig = field(default_factory=ModelCheckpointConfig)


@dataclass
class LoggerConfig:
    """Weights & Biases, offline by default: runs land in ``<output_dir>/wandb``; upload later with
    ``wandb sync <output_dir>/wandb/offline-run-*``."""

    name: str = "wandb"
    #: online | offline | disabled
    mode: str = "offline"
    project: str = "gpipe-lab"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


#: (group, name) of each generated node -> the dataclass it is generated from
SCHEMAS: dict[tuple[str, str], type] = {("pipeline", "schema"): PipelineOptions,
                                        ("callbacks", "schema"): CallbacksConfig,
                                        ("logger", "wandb_schema"): LoggerConfig}


def register_schemas() -> None:
    """Store the generated nodes (idempotent)."""
    for (group, name), schema in SCHEMAS.items():
        ConfigStore.instance().store(group=group, name=name, node=asdict(schema()))


register_schemas()

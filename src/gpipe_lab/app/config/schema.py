"""The config's schema: nodes generated from the code's dataclasses (so each default is written
once) and the error type every config check raises.

``pipeline/schema`` holds every ``PipelineOptions`` field with its dataclass default;
``conf/pipeline/default.yaml`` starts from it and lists only the default run's own
choices. Importing this module registers the nodes in Hydra's ``ConfigStore``
(``gpipe_lab.app.train`` and ``gpipe_lab.app.config.groups`` import it, so every compose sees them).
The node is a plain mapping, not a typed one: values are checked by
``gpipe_lab.app.config.groups.validate``, whose errors name the key and what is allowed.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hydra.core.config_store import ConfigStore

from gpipe_lab.pipeline.options import PipelineOptions


class ConfigError(ValueError):
    """A config that cannot run; the message starts with the key."""


def check_positive(value: Any, key: str) -> None:
    """Raises:
        ConfigError: ``value`` is set and not an integer >= 1 (naming ``key``).
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{key}: must be a positive integer, got {value!r}")


#: name of the generated node inside the ``pipeline`` group
PIPELINE_SCHEMA = "schema"


def register_schemas() -> None:
    """Store ``pipeline/schema`` (idempotent)."""
    ConfigStore.instance().store(group="pipeline", name=PIPELINE_SCHEMA, node=asdict(PipelineOptions()))


register_schemas()

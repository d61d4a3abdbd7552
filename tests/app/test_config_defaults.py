"""Each default of the ``callbacks`` and ``logger`` groups is written once: in its dataclass
(``gpipe_lab.app.config.schema``), whose generated node the group's YAML starts from."""

from __future__ import annotations

from dataclasses import asdict, fields

import pytest
from omegaconf import OmegaConf

from gpipe_lab.app.config.schema import CallbacksConfig, LoggerConfig
from helpers.app import CONF, make_config


@pytest.mark.parametrize(("path", "schema", "own"), [
    ("callbacks/default.yaml", CallbacksConfig, set()),
    ("logger/wandb.yaml", LoggerConfig, {"tags"}),  # the root key's tags: the run's choice, not a default
])
def test_the_yaml_restates_no_default_of_its_dataclass(path: str, schema: type, own: set[str]) -> None:
    written = set(OmegaConf.load(CONF / path)) - {"defaults"}
    assert written == own, f"{path} repeats defaults of {schema.__name__}: {sorted(written - own)}"
    assert own <= {f.name for f in fields(schema)}


def test_the_composed_groups_hold_the_dataclass_defaults() -> None:
    cfg = make_config("tags=[a]", "callbacks.timeline_pictures=true")  # the helper switches pictures off
    assert OmegaConf.to_container(cfg.callbacks) == asdict(CallbacksConfig())
    assert OmegaConf.to_container(cfg.logger, resolve=True) == {**asdict(LoggerConfig()), "tags": ["a"]}
    assert make_config("callbacks.keep_checkpoints=3").callbacks.keep_checkpoints == 3

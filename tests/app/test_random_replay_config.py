"""``pipeline.random_replay`` composes as ``auto`` (the default) or a bool (``false``: see
``test_options_wiring``); anything else is refused by the config check, naming the key, the value and the allowed ones."""

from __future__ import annotations

import pytest

from gpipe_lab.app.config.groups import validate
from gpipe_lab.app.config.schema import ConfigError
from helpers.app import make_config


@pytest.mark.parametrize(("overrides", "expected"), [((), "auto"), (("pipeline.random_replay=true",), True)])
def test_random_replay_composes(overrides: tuple[str, ...], expected: object) -> None:
    cfg = make_config(*overrides)
    assert cfg.pipeline.random_replay == expected and type(cfg.pipeline.random_replay) is type(expected)
    validate(cfg)


def test_a_bad_random_replay_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.random_replay: must be one of \['auto', True, False\], "
                                          r"got 'maybe'"):
        validate(make_config("pipeline.random_replay=maybe"))

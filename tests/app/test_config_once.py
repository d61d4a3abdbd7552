"""The config is checked in one place, once per run: ``gpipe_lab.app.config.check_config``.

A resumed, wandb-logged ``gpipe-train`` run (the case where the checkpoint is located, the run's
config recomposed and the logger named after the options) calls the entry once, and through it the pipeline group's check and the
checkpoint's resolution once each; a dry run and a sweep's check call the same entry.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers.app import SMALL, cli_here

#: the functions counted: the entry and the two checks the issue saw made two and three times per run
COUNTED = ("check_config", "validate_pipeline", "resolve_checkpoint")


def count_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """From now on, calls of ``COUNTED``, wherever a module of ``gpipe_lab`` holds one (its own
    module or an importer's)."""
    modules = [m for name, m in sys.modules.items() if name.startswith("gpipe_lab") and m is not None]
    originals: dict[str, Callable[..., Any]] = {}
    for module in modules:
        for name in COUNTED:
            function = getattr(module, name, None)
            if callable(function) and getattr(function, "__module__", "").startswith("gpipe_lab"):
                originals.setdefault(name, function)
    assert set(originals) == set(COUNTED), f"not imported: {set(COUNTED) - set(originals)}"
    counter: Counter[str] = Counter()

    def counting(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counter[name] += 1
            return function(*args, **kwargs)
        return call

    for module in modules:
        for name, function in originals.items():
            if getattr(module, name, None) is function:
                monkeypatch.setattr(module, name, counting(name, function))
    return counter


@pytest.mark.slow  # two gpipe-train runs: the one resumed and the resumed one (wandb-logged)
def test_a_resumed_run_checks_its_config_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    gpipe_train = cli_here(tmp_path, capsys, monkeypatch)
    # a folder of its own: two runs started within one second would share the timestamped one
    first = gpipe_train(*SMALL, "trainer.max_steps=2", "trainer.enable_checkpointing=true", "logger=csv",
                        f"hydra.run.dir={tmp_path / 'train' / 'runs' / 'first'}")
    assert first.code == 0, first.err[-3000:]
    calls = count_calls(monkeypatch)
    resumed = gpipe_train(*SMALL, "trainer.max_steps=3", "logger=wandb", "ckpt_path=last")
    assert resumed.code == 0, resumed.err[-3000:]
    assert "continuing run" in resumed.out, resumed.out[-2000:]
    assert dict(calls) == dict.fromkeys(COUNTED, 1)


def test_a_dry_run_checks_its_config_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    gpipe_train = cli_here(tmp_path, capsys, monkeypatch)
    calls = count_calls(monkeypatch)
    done = gpipe_train(*SMALL, "dry_run=true")
    assert done.code == 0, done.err[-3000:]
    assert dict(calls) == dict.fromkeys(COUNTED, 1)

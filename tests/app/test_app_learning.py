"""The app's built-in tasks are learnable with their defaults (CPU, bounded).

Each runs the console script's ``cli`` with the user's command line in this process
(``helpers.app.cli_here``): the same Hydra app without a new process's imports;
``test_train.py`` starts ``gpipe-train`` itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.app import cli_here


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_tiny_transformer_reaches_bleu_20_on_the_synthetic_language_pair(tmp_path: Path, capsys, monkeypatch) -> None:
    """`gpipe-train model=transformer_tiny data=synthetic_translation`: BLEU > 20."""
    done = cli_here(tmp_path, capsys, monkeypatch)("model=transformer_tiny", "data=synthetic_translation", "logger=csv")
    assert done.code in (0, None), done.err[-3000:]
    (summary_path,) = tmp_path.rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["validation_metric"] == "val/bleu"
    assert summary["validation_value"] > 20, summary
    assert summary["tokens_per_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_default_app_is_well_above_chance(tmp_path: Path, capsys, monkeypatch) -> None:
    """`gpipe-train` with no arguments: a small AmoebaNet-D, K=2, M=4, accuracy far above 1/10."""
    done = cli_here(tmp_path, capsys, monkeypatch)("logger=csv")
    assert done.code in (0, None), done.err[-3000:]
    (summary_path,) = tmp_path.rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert (summary["K"], summary["M"], summary["model"]) == (2, 4, "amoebanet_d_tiny")
    assert summary["validation_metric"] == "val/acc" and summary["validation_value"] > 0.5, summary

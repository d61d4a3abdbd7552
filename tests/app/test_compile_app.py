"""``pipeline.compile`` through ``gpipe-train``: compiled stages train like eager ones.

Two steps of a one-layer, narrow ``transformer_tiny`` at K=2, M=4, compiled with the
``aot_eager`` backend (the capture and compiled backward without Inductor's slow code
generation on 2 cores): the
per-step losses equal the eager run's within 1e-4, in the local transport (in-process)
and in the distributed one (two processes); the user is told when training and validation
compile. Inductor's ``No CUDA runtime`` log line on a CPU machine is kept out.
"""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

import pytest
import torch

from gpipe_lab.app.config.groups import ConfigError, validate_pipeline
from gpipe_lab.app.train import run
from gpipe_lab.lightning.known_warnings import silence_known_warnings
from helpers.app import gpipe_train, make_config

STEPS = 2
#: dynamo's and AOT autograd's time grows with the traced ops: one layer each side, narrow
SMALL_MODEL = ["model.num_layers=1", "model.d_model=16", "model.ffn_dim=32", "model.num_heads=2"]
COMPILE = "pipeline.compile={backend:aot_eager}"
COMMON = [
    "model=transformer_tiny", *SMALL_MODEL, "data=synthetic_translation", "logger=csv", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "trainer.limit_test_batches=0",
    "+trainer.enable_model_summary=false",
    "trainer.enable_checkpointing=false", "callbacks.checkpoint_every_n_steps=null", f"trainer.max_steps={STEPS}",
    "seed=7", "pipeline.partitions=2", "pipeline.chunks=4", "data.batch_size=8", f"data.num_train={8 * STEPS}",
    "data.num_val=8", "data.min_len=6", "data.max_len=6",  # one sequence length: no recompile for a new one
]


def _losses(run_root: Path) -> list[float]:
    """The per-step training losses the CSV logger wrote under ``run_root``."""
    files = sorted(run_root.rglob("metrics.csv"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        rows = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    return [rows[s] for s in sorted(rows)]


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The eager run's per-step losses (one run for both transports' comparisons)."""
    root = tmp_path_factory.mktemp("eager")
    run(make_config(*COMMON, tmp_path=root))
    losses = _losses(root)
    assert len(losses) == STEPS
    return losses


@pytest.mark.slow
def test_compiled_app_matches_eager(eager_losses: list[float], tmp_path: Path, capsys) -> None:
    # one validation batch after the last step (the losses compared are the steps' before it)
    run(make_config(*COMMON, COMPILE, "trainer.limit_val_batches=1", tmp_path=tmp_path / "compiled"))
    assert _losses(tmp_path / "compiled") == pytest.approx(eager_losses, abs=1e-4, rel=1e-4)
    out = capsys.readouterr().out  # the user is told that the first step compiles, then how long it took
    assert "pipeline.compile: torch.compile is building each stage's kernels during the first step" in out
    assert re.search(r"pipeline.compile: the first step, compilation included, took \d+\.\d s", out), out[-2000:]
    # and so is validation's first batch, which compiles other (gradient-free) kernels
    assert ("pipeline.compile: torch.compile is building each stage's kernels during the first validation batch"
            in out), out[-2000:]
    assert re.search(r"pipeline.compile: the first validation batch, compilation included, took \d+\.\d s",
                     out), out[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is a CPU machine's")
def test_inductors_no_cuda_runtime_warning_is_kept_out(tmp_path: Path, monkeypatch) -> None:
    """Inductor imports ``torch.utils.cpp_extension``, which logs ``No CUDA runtime is found,
    using CUDA_HOME=...`` on a CPU machine with a CUDA toolkit; the app drops that line only."""
    from torch.utils import cpp_extension

    silence_known_warnings()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(cpp_extension.__name__)
    logger.addHandler(handler)
    try:
        monkeypatch.setenv("CUDA_HOME", str(tmp_path))
        assert cpp_extension._find_cuda_home() == str(tmp_path)  # the call that logs it at import
        logger.warning("another warning")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another warning"], seen


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_compiled_distributed_transport_matches_eager(eager_losses: list[float], tmp_path: Path) -> None:
    (tmp_path / "compiled").mkdir()
    gpipe_train([*COMMON, COMPILE, "pipeline.transport=distributed", "trainer=distributed"],
                tmp_path / "compiled", timeout=360, torchrun=2)  # each rank forked, as torchrun starts them
    assert _losses(tmp_path / "compiled") == pytest.approx(eager_losses, abs=1e-4, rel=1e-4)


def test_bad_compile_key_names_the_option() -> None:
    with pytest.raises(ConfigError, match="pipeline.compile: 'modee' is not a torch.compile keyword"):
        validate_pipeline(make_config("pipeline.compile={modee:x}"))

"""``gpipe-train`` gives the same losses with the local and the distributed transport.

Same seed, K=2, M=4, three steps of each default model (AmoebaNet-D with BatchNorm on
synthetic images, the tiny Transformer on synthetic translation): the per-step training
losses of ``pipeline.transport=distributed trainer=distributed`` (two processes) equal the
local transport's to 1e-5. Every rank must compute with the intra-op thread count a local
stage uses, or kernels reduce in another order and BatchNorm amplifies the difference.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from gpipe_lab.app.train import run
from helpers.app import gpipe_train, make_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS = 3
COMMON = [
    "logger=csv", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=0", "+trainer.enable_model_summary=false", "trainer.enable_checkpointing=false",
    "callbacks.checkpoint_every_n_steps=null", f"trainer.max_steps={STEPS}", "seed=7",
    "pipeline.partitions=2", "pipeline.chunks=4", "data.batch_size=16", f"data.num_train={16 * STEPS}",
    "data.num_val=16",
    # the same count on every rank and stage, whatever the load when each transport builds its pipeline
    "pipeline.threads_per_stage=1",
]
MODELS = {
    "amoebanet_d_tiny": ["model=amoebanet_d_tiny", "data=synthetic_images"],
    "transformer_tiny": ["model=transformer_tiny", "data=synthetic_translation"],
}


def train_losses(run_root: Path) -> list[float]:
    """The per-step training losses the CSV logger wrote under ``run_root``."""
    files = sorted(run_root.rglob("metrics.csv"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        rows = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    return [rows[s] for s in sorted(rows)]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_distributed_transport_matches_local(model: str, tmp_path: Path) -> None:
    run(make_config(*MODELS[model], *COMMON, tmp_path=tmp_path / "local"))  # in-process: no start-up
    local = train_losses(tmp_path / "local")
    (tmp_path / "distributed").mkdir()
    # started as torchrun starts it (each rank forked); Lightning's own launcher is tested in test_multiprocess
    gpipe_train([*MODELS[model], *COMMON, "pipeline.transport=distributed", "trainer=distributed"],
                tmp_path / "distributed", timeout=240, torchrun=2)
    distributed = train_losses(tmp_path / "distributed")
    assert len(local) == STEPS, local
    assert distributed == pytest.approx(local, abs=1e-5, rel=0), (local, distributed)

"""``gpipe-export CKPT OUT``: a checkpoint of any K and transport as the unpipelined model's plain
``state_dict`` (tensors only: ``torch.load(..., weights_only=True)`` reads it without the lab), which
computes what the pipeline computes; a file that cannot be exported is one line. (The distributed
transport's checkpoints: ``tests/app/test_resume_matrix.py``, which has them.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpipe_lab.models import build
from gpipe_lab.pipeline import GPipe
from helpers.app import SMALL, gpipe_train, numbered_copy
from helpers.forked import run_module

MODEL = ("amoebanet_d_tiny", {"num_filters": 8, "image_size": 8, "num_classes": 10})
RUN = [*SMALL, "trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.enable_checkpointing=true"]


def export(ckpt: Path, out: Path) -> str:
    proc = run_module("gpipe_lab.app.export", [str(ckpt), str(out)], cwd=out.parent, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def assert_exported_model_computes_as_the_pipeline(ckpt: Path, out: Path, partitions: int) -> None:
    """The export, loaded strictly into a fresh unpipelined model, gives the outputs of a K-stage
    pipeline holding the checkpoint's weights (evaluation mode, one batch)."""
    name, sizes = MODEL
    plain = build(name, **sizes)
    plain.load_state_dict(torch.load(out, weights_only=True))  # strict: every weight, under its name
    layers = build(name, **sizes)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    layers.load_state_dict({k.removeprefix("layers."): v for k, v in saved.items()})
    pipe = GPipe(layers, partitions=partitions, chunks=4)
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    plain.eval()
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), pipe(x), rtol=0, atol=1e-5)


def test_an_export_loads_into_the_unpipelined_model_and_computes_as_the_pipeline(tmp_path):
    run_dir = tmp_path / "run"
    gpipe_train([*RUN, "pipeline.partitions=3", f"hydra.run.dir={run_dir}"], tmp_path)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    line = export(ckpt, tmp_path / "model.pt")
    assert f"-> {tmp_path / 'model.pt'}" in line and "weights_only=True" in line
    assert_exported_model_computes_as_the_pipeline(ckpt, tmp_path / "model.pt", partitions=3)

    # a checkpoint naming its layers by index (the distributed transport's, before it kept the names)
    # is renamed after the model of its run's saved config
    indexed = run_dir / "checkpoints" / "indexed.ckpt"
    numbered_copy(ckpt, indexed)
    export(indexed, tmp_path / "from_indexed.pt")
    exported, renamed = (torch.load(tmp_path / f, weights_only=True) for f in ("model.pt", "from_indexed.pt"))
    assert list(renamed) == list(exported) and all(torch.equal(renamed[k], exported[k]) for k in exported)


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", None])
def test_a_file_that_cannot_be_exported_is_one_line(tmp_path, content):
    ckpt = tmp_path / "x.ckpt"
    if content is not None:
        ckpt.write_bytes(content)
    proc = run_module("gpipe_lab.app.export", [str(ckpt), str(tmp_path / "out.pt")], cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"export error: checkpoint={ckpt}: ") and not (tmp_path / "out.pt").exists()

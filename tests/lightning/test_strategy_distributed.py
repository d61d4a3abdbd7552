"""GPipeStrategy(transport="distributed"): Lightning launches one process per stage (gloo on
CPU); losses equal the local transport's, clipping uses the global norm across stages, and
the checkpoint written by two processes resumes in one process at another K; a metric computed
from the outputs (last stage only) reaches global rank 0, where the loggers write. The layers
are built in ``configure_model`` (on meta): each rank allocates only its own stage. The same
launched script then checks the non-finite policy on both ranks (``skip``, a 16-mixed overflow
under the GradScaler, ``raise``): one launch, since each costs seconds of Lightning imports
per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpipe_lab.lightning import GPipeStrategy
from helpers.faults import Faulty
from helpers.strategy import MetaRegressor, RecordMetric, TinyData, TinyRegressor, trainer

SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from helpers.strategy import MetaRegressor, RecordMetric, TinyData, trainer
from gpipe_lab.lightning import GPipeStrategy
m = MetaRegressor()
strategy = GPipeStrategy(partitions=2, chunks=4, transport="distributed", seed=0, timeout=60)
record = RecordMetric("train/output_mean")
t = trainer(strategy, devices=2, max_epochs=1, gradient_clip_val=0.05, limit_val_batches=2, callbacks=[record])
t.fit(m, TinyData())
t.save_checkpoint({ckpt!r})
allocated = sum(not p.is_meta for p in m.layers.parameters())
json.dump({{"built_on": str(m.built_on), "allocated": allocated}}, open({out!r} + str(t.global_rank), "w"))
if t.global_rank == 0:
    json.dump({{"losses": m.losses, "val": float(t.callback_metrics["val/loss"]),
               "sampler": strategy.distributed_sampler_kwargs, "output_mean": record.values}},
              open({out!r}, "w"))

from helpers.faults import Faulty
out = {{}}
m = Faulty()
s = GPipeStrategy(partitions=2, chunks=4, transport="distributed", seed=0, timeout=60, nonfinite="skip")
t = trainer(s, devices=2, max_steps=4, gradient_clip_val=0.05)  # clipping is a collective: skipped alike
t.fit(m, TinyData())
out["skip"] = [s.pipe.skipped_steps, m.optimizer_steps, m.losses, float(t.callback_metrics["train/skipped_steps"])]
import torch
from lightning.pytorch.plugins import MixedPrecision
m = Faulty(where="backward")  # stage 0's gradients are inf at BAD_STEP; stage 1's are finite
s = GPipeStrategy(partitions=2, chunks=4, transport="distributed", seed=0, timeout=60)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
t = trainer(s, devices=2, max_steps=5, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
t.fit(m, TinyData())
out["amp"] = [m.optimizer_steps, s.precision_plugin.scaler.get_scale()]
t = trainer(GPipeStrategy(partitions=2, chunks=4, transport="distributed", seed=0, timeout=60), devices=2,
            max_steps=4)
try:
    t.fit(Faulty(where="backward"), TinyData())
except Exception as exc:
    out["raise"] = f"{{type(exc).__name__}}: {{exc}}"
json.dump(out, open({nonfinite!r} + str(t.global_rank), "w"))
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script's directory after one run on two ranks (``dist.ckpt``, ``out.json*``, ``nonfinite.json*``)."""
    tmp_path = tmp_path_factory.mktemp("distributed-strategy")
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1]), ckpt=str(tmp_path / "dist.ckpt"),
                                    out=str(tmp_path / "out.json"), nonfinite=str(tmp_path / "nonfinite.json")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp_path


@pytest.mark.slow
def test_distributed_transport_matches_local_and_resumes(launched: Path) -> None:
    ckpt, out = launched / "dist.ckpt", launched / "out.json"
    result = json.loads(out.read_text())
    assert result["sampler"] == {"num_replicas": 1, "rank": 0}  # shard by replica, not by stage
    ranks = [json.loads(Path(f"{out}{r}").read_text()) for r in (0, 1)]
    assert [r["built_on"] for r in ranks] == ["meta", "meta"]
    total = len(list(TinyRegressor().parameters()))
    assert sum(r["allocated"] for r in ranks) == total and all(0 < r["allocated"] < total for r in ranks)

    full = MetaRegressor()
    record = RecordMetric("train/output_mean")
    local = trainer(GPipeStrategy(partitions=2, chunks=4, seed=0), max_epochs=2, gradient_clip_val=0.05,
                    limit_val_batches=2, callbacks=[record])
    local.fit(full, TinyData())
    assert result["losses"] == pytest.approx(full.losses[:4], abs=1e-5)
    # computed from the outputs, i.e. on the last stage's rank, yet global rank 0 (the logger's) has it
    assert None not in record.values[:4]
    assert result["output_mean"] == pytest.approx(record.values[:4], abs=1e-5)

    saved = torch.load(ckpt, weights_only=False)
    assert set(saved["state_dict"]) == set(TinyRegressor().state_dict())  # both stages, original names
    assert len(saved["optimizer_states"][0]["state"]) == len(list(TinyRegressor().parameters()))
    resumed = TinyRegressor()
    trainer(GPipeStrategy(partitions=4, chunks=4, seed=0), max_epochs=2, gradient_clip_val=0.05).fit(
        resumed, TinyData(), ckpt_path=ckpt)
    assert resumed.losses == pytest.approx(full.losses[4:], abs=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_strategy_skips_and_raises_on_every_rank(launched: Path) -> None:
    """``nonfinite="skip"`` skips the same step on both ranks (equal to the local transport);
    under a ``GradScaler`` (16-mixed) an inf on stage 0 only makes BOTH ranks skip the step and
    back off; ``"raise"`` raises the engine's error naming the step and the stage on both."""
    local = Faulty()
    trainer(GPipeStrategy(partitions=2, chunks=4, seed=0, nonfinite="skip"), max_steps=4,
            gradient_clip_val=0.05).fit(local, TinyData())
    for rank in (0, 1):
        out = json.loads((launched / f"nonfinite.json{rank}").read_text())
        skipped, steps, losses, logged = out["skip"]
        assert (skipped, steps, logged) == (1, 3, 1.0), rank
        good = [0, 1, 3]
        assert [losses[i] for i in good] == pytest.approx([local.losses[i] for i in good], abs=1e-5), rank
        assert out["amp"] == [4, 128.0], rank  # both ranks skip the overflowing step and back off once
        assert out["raise"] == ("NonFiniteError: step 2: gradients of stage 0 are not finite "
                                "(set nonfinite='skip' to skip such steps)"), rank

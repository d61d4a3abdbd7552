"""The product-path row: ``gpipe-train``'s step (Lightning + ``GPipeStrategy``) vs the raw engine's.

One run, alternating rounds: ``gpipe-train``'s pieces (``gpipe_lab.app.train``'s datamodule,
module and logger, ``GPipeStrategy``, CSV logging on, progress bar off) train the Table-2
analogue; at the start of every training batch a callback runs the raw engine on the same
batch (``GPipe.train_step`` + the optimizer step, on a second copy of the model with the
same K, M and options), timed on its own. The product path's step is the time between two
batch starts less that raw step, so it includes everything Lightning does per step (data
loading, hooks, logging, the optimizer step). Lightning's loop cannot be called step by
step, so this uses the callback rather than ``gpipe_lab.pipeline.measuring.call_timing.time_rounds``; the two paths
still alternate every round. Ratio = raw step / product step (target >= 0.95).

With ``--transport distributed`` both paths run one process per stage over gloo: Lightning
launches the K processes (``pipeline.transport=distributed``, as ``gpipe-train`` does), and
the raw path is ``DistributedGPipe`` on the same process group, built once the group exists
and driven by hand in the same callback; rank 0 prints the result.

    python -m benchmarks.bench_product_path --model transformer            # the Table-2 analogue
    python -m benchmarks.bench_product_path --model amoebanet --quick      # 6 (4) layers, mini-batch 32
    python -m benchmarks.bench_product_path --model transformer --quick --transport distributed
    python -m benchmarks.bench_product_path --model transformer --layers 6   # the config's batch, 6 layers
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra import compose, initialize_config_dir

import gpipe_lab.app.config.schema  # noqa: F401  (registers the generated pipeline/schema node)
from gpipe_lab.app.config.groups import validate_pipeline
from gpipe_lab.app.train import build_datamodule, build_module, engine_options
from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.pipeline import GPipe

CONF = Path(__file__).resolve().parents[1] / "conf"


class Alternate(pl.Callback):
    """Runs ``raw_step(batch)`` at each batch start; keeps both paths' step times."""

    def __init__(self, raw_step: Any, warmup: int, build: Any = None) -> None:
        self.raw_step, self.warmup, self.build = raw_step, warmup, build
        self.product: list[float] = []
        self.raw: list[float] = []
        self._start: float | None = None
        self._raw_s = 0.0
        self._batches = 0  # over epochs: Lightning's batch_idx restarts at each one

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        if self.build is not None:  # the raw engine needs the process group Lightning has just made
            self.build()

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        if self._start is not None and self._batches > self.warmup:
            self.product.append(now - self._start - self._raw_s)
            self.raw.append(self._raw_s)
        self._batches += 1
        self._start = now
        self.raw_step(batch)
        self._raw_s = time.perf_counter() - now


def compose_config(model: str, quick: bool, compiled: bool, steps: int, transport: str = "local",
                   layers: int | None = None) -> Any:
    """The ``experiment=paper_table2_<model>`` config (smaller with ``quick``; ``layers`` overrides
    ``model.num_layers`` only, keeping the config's mini-batch)."""
    overrides = [f"experiment=paper_table2_{model}", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
                 "trainer.enable_progress_bar=false", "logger=csv"]
    if quick:
        layers = 6 if model == "amoebanet" else 4  # AmoebaNet's layers come in threes
        overrides += [f"model.num_layers={layers}", "data.batch_size=32"]
    if layers is not None:
        overrides.append(f"model.num_layers={layers}")
    if compiled:
        overrides.append("pipeline.compile=true")
    if transport != "local":
        overrides.append(f"pipeline.transport={transport}")
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    # one epoch holds every step, so no epoch boundary falls inside the timed rounds
    cfg.data.num_train = cfg.data.batch_size * steps
    return cfg


def run_product_path(model: str, quick: bool, compiled: bool, repeats: int, warmup: int = 2,
                     transport: str = "local", layers: int | None = None) -> dict[str, Any] | None:
    """Median step seconds of both paths and their ratio (raw / product); ``None`` on ranks > 0."""
    cfg = compose_config(model, quick, compiled, warmup + repeats + 1, transport, layers)
    data = build_datamodule(cfg)
    module, twin = build_module(cfg, data), build_module(cfg, data)
    twin.load_state_dict(module.state_dict())
    options = engine_options(cfg, validate_pipeline(cfg), module)  # as gpipe-train makes them
    engine: list[Any] = []
    optimizers: list[Any] = []

    def build() -> None:
        if transport == "local":
            pipe: Any = GPipe(twin.configure_layers(), options=options)
        else:
            from gpipe_lab.pipeline.distributed import DistributedGPipe

            pipe = DistributedGPipe(twin.configure_layers(), options=options)
        optimizer = twin.configure_optimizers()  # over this rank's stage's parameters
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        engine[:], optimizers[:] = [pipe], [optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer]

    def raw_step(batch: Any) -> None:
        inputs, targets = twin.split_batch(batch)
        optimizers[0].zero_grad(set_to_none=True)
        engine[0].train_step(inputs, targets, twin.loss_fn, twin.loss_normalizer)
        optimizers[0].step()

    timer = Alternate(raw_step, warmup, build)
    strategy = GPipeStrategy(options=options)
    devices = 1 if transport == "local" else options.num_stages
    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=cfg.trainer.max_steps,
                             limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, logger=pl.loggers.CSVLogger(logs),
                             log_every_n_steps=1, callbacks=[timer])
        trainer.fit(module, datamodule=data)
    if trainer.global_rank != 0:
        return None
    product, raw = statistics.median(timer.product), statistics.median(timer.raw)
    return {"model": model, "K": options.num_stages, "M": options.chunks, "compile": compiled, "transport": transport,
            "product_step_s": product, "raw_step_s": raw, "ratio": raw / product, "rounds": len(timer.product),
            "product_rounds_s": timer.product, "raw_rounds_s": timer.raw}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["transformer", "amoebanet"], default="transformer")
    parser.add_argument("--quick", action="store_true", help="6-layer AmoebaNet / 4-layer Transformer at mini-batch 32")
    parser.add_argument("--compile", action="store_true", help="both paths with compiled stages")
    parser.add_argument("--transport", choices=["local", "distributed"], default="local",
                        help="distributed: one process per stage over gloo, launched by Lightning")
    parser.add_argument("--layers", type=int, default=None, help="model.num_layers (the config's mini-batch kept)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = parser.parse_args()
    result = run_product_path(args.model, args.quick, args.compile, args.repeats, args.warmup, args.transport,
                              args.layers)
    if result is not None:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

"""GPU check sections on the system: Lightning, 16-mixed AMP, NCCL start-up, two GPUs (see gpu_check.py).

A dry run runs each at tiny sizes on the CPU (gloo instead of NCCL, CPU stages
instead of two GPUs), so every path is wired without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_check_engine import Context, _grad_error
from gpipe_lab.lightning import GPipeStrategy, PipelineModule
from gpipe_lab.pipeline import GPipe


class _Regressor(PipelineModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                    nn.Linear(width, 1))
        self.losses: list[float] = []

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs.float(), targets)

    def log_train(self, loss: torch.Tensor, outputs: object, targets: object) -> None:
        self.losses.append(float(loss))
        super().log_train(loss, outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def lightning_run(ctx: Context) -> dict[str, Any]:
    """bf16-mixed, two stages on one device, 30 steps: loss finite and falling; checkpoint saved and reloaded."""
    width, steps = (8, 6) if ctx.dry else (512, 30)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * steps, width, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=64)
    accelerator = "cpu" if ctx.dry else "gpu"
    with tempfile.TemporaryDirectory() as folder:
        def trainer(max_steps: int) -> pl.Trainer:
            return pl.Trainer(accelerator=accelerator, devices=1, precision="bf16-mixed", max_steps=max_steps,
                              strategy=GPipeStrategy(partitions=2, chunks=4, stage_devices=[str(ctx.device)] * 2),
                              logger=False, enable_progress_bar=False, enable_model_summary=False,
                              default_root_dir=folder, num_sanity_val_steps=0, limit_val_batches=0)
        module = _Regressor(width)
        first = trainer(steps)
        start = time.perf_counter()
        first.fit(module, data)
        seconds = time.perf_counter() - start
        path = Path(folder) / "check.ckpt"
        first.save_checkpoint(path)
        resumed = _Regressor(width)
        trainer(steps + 2).fit(resumed, data, ckpt_path=str(path))
        reloaded = len(resumed.losses) == 2
    losses = module.losses
    finite = all(torch.isfinite(torch.tensor(losses)))
    falling = sum(losses[-3:]) < sum(losses[:3])
    ok = finite and falling and reloaded
    return {"status": "PASS" if ok else "FAIL", "steps": len(losses), "first_losses": losses[:3],
            "last_losses": losses[-3:], "finite": finite, "falling": falling, "checkpoint_reloaded": reloaded,
            "samples_per_second": round(64 * len(losses) / seconds, 1)}


class _Watch(pl.Callback):
    """Per training batch: the scaler's scale before and after, and whether the weights moved."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._before: tuple[float, list[torch.Tensor]] = (0.0, [])

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, i: int) -> None:
        scaler = trainer.precision_plugin.scaler
        self._before = (scaler.get_scale(), [p.detach().clone() for p in module.parameters()])

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any,
                           i: int) -> None:
        scale, weights = self._before
        moved = any(not torch.equal(a, b) for a, b in zip(weights, module.parameters()))
        after = trainer.precision_plugin.scaler.get_scale()
        self.rows.append({"batch": i, "scale_before": scale, "scale_after": after,
                          "weights_moved": moved})


def amp_fp16(ctx: Context) -> dict[str, Any]:
    """16-mixed with a GradScaler, an inf injected in batch 2: that step skipped and the scale halved."""
    width, bad = (8, 2) if ctx.dry else (512, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 5, width, generator=g)
    x[64 * bad] = float("inf")  # one sample of batch ``bad``: its loss and gradients are not finite
    data = DataLoader(TensorDataset(x, torch.zeros(len(x), 1)), batch_size=64)
    device = "cpu" if ctx.dry else "cuda"
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    watch = _Watch()
    with tempfile.TemporaryDirectory() as folder:
        trainer = pl.Trainer(accelerator="cpu" if ctx.dry else "gpu", devices=1, max_steps=5,
                             callbacks=[watch],
                             plugins=[MixedPrecision("16-mixed", device, scaler=scaler)],
                             strategy=GPipeStrategy(partitions=2, chunks=4,
                                                    stage_devices=[str(ctx.device)] * 2),
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir=folder, num_sanity_val_steps=0,
                             limit_val_batches=0)
        trainer.fit(_Regressor(width), data)
    rows = watch.rows
    skipped = len(rows) > bad and not rows[bad]["weights_moved"]
    halved = rows[bad]["scale_before"] * scaler.get_backoff_factor() if len(rows) > bad else None
    backed_off = len(rows) > bad and rows[bad]["scale_after"] == halved
    others = all(r["weights_moved"] and r["scale_after"] == r["scale_before"]
                 for r in rows if r["batch"] != bad)
    ok = len(rows) == 5 and skipped and backed_off and others
    return {"status": "PASS" if ok else "FAIL", "inf_batch": bad, "inf_step_skipped": skipped,
            "scale_backed_off": backed_off, "other_steps_taken_at_same_scale": others, "batches": rows}


def nccl_startup(ctx: Context) -> dict[str, Any]:
    """A one-rank process group (NCCL, gloo in a dry run) and a DistributedGPipe step: start-up seconds."""
    from gpipe_lab.pipeline.distributed import DistributedGPipe

    backend = "gloo" if ctx.dry else "nccl"
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group(backend, init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            init = time.perf_counter() - start
            pipe = DistributedGPipe(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), partitions=1,
                                    chunks=2, device=ctx.device, seed=0)
            x, y = torch.randn(4, 8, device=ctx.device), torch.randn(4, 2, device=ctx.device)
            loss = pipe.train_step(x, y, F.mse_loss)
            finite = bool(torch.isfinite(loss))
        finally:
            dist.destroy_process_group()
    return {"status": "PASS" if finite else "FAIL", "backend": backend, "init_seconds": round(init, 3),
            "first_step_done_seconds": round(time.perf_counter() - start, 3)}


def _overlap(pipe: GPipe) -> float:
    """Fraction of the step during which both stages compute at once, on the device's clock (CUDA
    events: host times would be launch times)."""
    timeline = pipe.timeline.on_device()
    busy = [[(e.start, e.end) for e in timeline.events if e.stage == k and e.kind != "wait"] for k in (0, 1)]
    both = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in busy[0] for b0, b1 in busy[1])
    return both / max(timeline.wall, 1e-9)


def two_gpus(ctx: Context) -> dict[str, Any]:
    """The two-rank demo (5 steps, 60 s timeout) and the local transport over two devices: its
    gradients against the unpipelined model's (fp32, 1e-5) and its overlap."""
    if not ctx.dry and torch.cuda.device_count() < 2:
        return {"status": "SKIP", "reason": f"{torch.cuda.device_count()} GPU(s) visible"}
    size = ["--width", "16", "--hidden", "32", "--blocks", "2", "--batch", "16"] if ctx.dry else []
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "-m", "gpipe_lab.pipeline.distributed.demo", "--steps", "5", *size]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
        demo = {"returncode": done.returncode, "tail": (done.stdout + done.stderr)[-600:]}
    except subprocess.TimeoutExpired:
        demo = {"returncode": None, "tail": "timed out after 60 s"}
    devices = ["cpu", "cpu"] if ctx.dry else ["cuda:0", "cuda:1"]
    width = 16 if ctx.dry else 4096
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the unpipelined reference in full float32
    module = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])
    x = torch.randn(64 if ctx.dry else 512, width, device=ctx.device)
    grad_error = _grad_error(module, x, x, F.mse_loss, ctx, partitions=2, chunks=8, devices=devices)
    pipe = GPipe(module, partitions=2, chunks=8, devices=devices)
    pipe.train_step(x, x, F.mse_loss)
    pipe.train_step(x, x, F.mse_loss)
    overlap = _overlap(pipe)
    ok = demo["returncode"] == 0 and grad_error <= 1e-5
    return {"status": "PASS" if ok else "FAIL", "demo": demo, "local_devices": devices,
            "grad_relative_error_vs_unpipelined": grad_error, "stage_overlap_fraction": round(overlap, 3),
            "overlap_clock": "device (CUDA events)" if not ctx.dry else "host (CPU, dry run)"}

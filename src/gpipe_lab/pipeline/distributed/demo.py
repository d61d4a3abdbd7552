"""Train the 8-block MLP with DistributedGPipe; launch with torchrun.

    torchrun --nproc-per-node 2 -m gpipe_lab.pipeline.distributed.demo --chunks 8
    torchrun --nproc-per-node 4 -m gpipe_lab.pipeline.distributed.demo --stages 2   # D=2 × K=2

Every replica draws its own slice of a synthetic regression task (``dp_rank``
/ ``dp_size``); rank 0 prints the loss, the measured and theoretical bubble.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline.devices.cpu_share import default_threads
from gpipe_lab.pipeline.distributed.distributed_gpipe import DistributedGPipe
from gpipe_lab.pipeline.distributed.resolve import (
    local_rank_device,
    nccl_failure_settings,
    process_group_device,
)
from gpipe_lab.pipeline.schedules import analytic_bubble


def mlp(width: int, hidden: int, blocks: int) -> nn.Sequential:
    """``blocks`` × Linear(width, hidden)-GELU-Linear(hidden, width)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
                           for _ in range(blocks)])


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, join the process group (torchrun's environment) and train."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=None, help="K (default: the world size)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=256, help="per replica")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # before the process group: its communicators bind to the current device
        torch.cuda.set_device(local_rank_device(os.environ.get("LOCAL_RANK", "0"), torch.cuda.device_count()))
    dist.init_process_group(backend, timeout=nccl_failure_settings(), **process_group_device(backend))
    if backend == "gloo":
        torch.set_num_threads(default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    K = args.stages or dist.get_world_size()
    pipe = DistributedGPipe(lambda: mlp(args.width, args.hidden, args.blocks), partitions=K, chunks=args.chunks,
                            schedule=args.schedule, virtual_stages=args.virtual_stages, seed=0)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    teacher = torch.Generator().manual_seed(1234)
    target_map = torch.randn(args.width, args.width, generator=teacher) / args.width ** 0.5
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * pipe.dp_size + pipe.dp_rank)  # this replica's slice
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.tanh(x @ target_map)
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.train_step(x.to(pipe.device), y.to(pipe.device), F.mse_loss)
        optimizer.step()
        timeline = pipe.gather_timeline()
        if dist.get_rank() == 0:
            theory = analytic_bubble(K, args.chunks, args.virtual_stages)
            print(f"step {step}: loss {loss.item():.5f}  wall {timeline.wall:.3f} s  "
                  f"bubble {timeline.measured_bubble():.2f} (theory {theory:.2f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

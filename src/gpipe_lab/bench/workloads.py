"""The benchmarks' MLP workload: 8 blocks of (Linear width→hidden, GELU, Linear hidden→width).

Each builder seeds torch first: two builds give the same weights and the same batch. The
workload type and the preset workloads (``Workload``, ``WorkloadSpec``, ``tiny_linear``) are
the planner's (``gpipe_lab.planner.workload``).
"""

from __future__ import annotations

import torch
from torch import nn

from gpipe_lab.planner.workload import Workload, mse


def mlp_module(width: int, hidden: int, blocks: int = 8) -> nn.Sequential:
    """``blocks`` × (Linear width→hidden, GELU, Linear hidden→width), as one flat sequence."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def mlp(batch: int, width: int, hidden: int, blocks: int = 8, partitions: int = 2, seed: int = 0) -> Workload:
    """The MLP on a random regression batch (MSE), whole blocks split evenly over ``partitions``.

    Raises:
        ValueError: ``partitions`` outside 1..``blocks``.
    """
    if not 1 <= partitions <= blocks:
        raise ValueError(f"partitions must be in 1..{blocks} (whole blocks per stage), got {partitions}")
    torch.manual_seed(seed)
    module = mlp_module(width, hidden, blocks)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    balance = [3 * (blocks // partitions + (k < blocks % partitions)) for k in range(partitions)]
    return Workload("mlp", module, x, y, mse, balance,
                    {"batch": batch, "width": width, "hidden": hidden, "blocks": blocks})

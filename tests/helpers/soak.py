"""The soak workload shared by both transports' soak tests: an MLP with large activations."""

from __future__ import annotations

import os

import torch
from torch import nn

STEPS, WARMUP = 200, 40
K, M = 2, 8
WIDTH, BATCH = 128, 64
# A leak of one micro-batch's saved activations of one stage is about 4 KiB x 20 tensors;
# one step leaking everything it saved is ~1 MiB; 160 post-warm-up steps -> over 100 MiB.
ALLOWED_GROWTH = 24 * 2**20


def rss_bytes() -> int:
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, WIDTH)]
    for _ in range(5):
        layers += [nn.GELU(), nn.Dropout(0.1), nn.Linear(WIDTH, WIDTH)]
    layers += [nn.Tanh(), nn.Linear(WIDTH, 10)]
    return nn.Sequential(*layers)

"""Shared pieces of the benchmarks: run sizes, workloads, machine facts, robust timing.

A *workload* is a layer sequence plus one mini-batch, its targets, a loss and a
balance for K stages. Every benchmark builds the module afresh from the same
seed, so the pipelined, unpipelined and torch.distributed.pipelining runs train
the same model on the same data.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.models import build, layer_costs, token_cross_entropy
from gpipe_lab.pipeline import balance_by_cost, retain_freed_memory

#: our schedules beyond torch's ScheduleGPipe / Schedule1F1B, measured beside them on the MLP:
#: split backward, weight gradients batched (gpipe-bw) or moved into the bubble (zb-h1, zb-h2)
BEYOND_TORCH = ("gpipe-bw", "zb-h1", "zb-h2")

CHECKPOINTS = ("never", "except_last", "always")


@dataclass(frozen=True)
class Sizes:
    """How much a run measures; ``smoke`` < ``quick`` < ``full``."""

    name: str
    mlp_batch: int
    mlp_hidden: tuple[int, int]   # (width, ffn width)
    microbatches: tuple[int, ...]  # M for the MLP grid
    model_microbatches: tuple[int, ...]  # M for the Transformer / AmoebaNet grids
    checkpoints: tuple[str, ...]
    model_checkpoints: tuple[str, ...]
    torch_microbatches: tuple[int, ...]
    repeats: int
    warmup: int
    models: tuple[str, ...] = ("mlp", "transformer", "amoebanet")
    overhead_microbatches: int = 64
    distributed: bool = True
    # M at which the MLP also runs the re-materializing modes (empty: every M)
    recompute_microbatches: tuple[int, ...] = ()
    gloo_repeats: int = 0  # repeats of the gloo side-by-side rounds (0: ``repeats``)
    beyond_torch: tuple[str, ...] = BEYOND_TORCH  # our other schedules measured beside torch's (MLP)


SIZES = {
    "smoke": Sizes("smoke", 64, (32, 64), (1, 4), (2,), ("never", "always"), ("never",), (4,), 1, 0,
                   overhead_microbatches=8),
    "quick": Sizes("quick", 1024, (512, 2048), (4, 8, 16), (8,), ("never", "always"), ("never",), (8, 16),
                   3, 1, recompute_microbatches=(8,), gloo_repeats=9, beyond_torch=("gpipe-bw",)),
    "full": Sizes("full", 1024, (512, 2048), (1, 2, 4, 8, 16, 32), (1, 2, 4, 8, 16, 32), CHECKPOINTS,
                  CHECKPOINTS, (2, 4, 8, 16, 32), 5, 2, overhead_microbatches=128),
}


@dataclass
class Workload:
    """A module to pipeline with its mini-batch, loss and balance."""

    name: str
    module: nn.Sequential
    inputs: Tensor | tuple[Tensor, ...]
    targets: Tensor
    loss_fn: Callable[[object, object], Tensor]
    balance: list[int]
    info: dict[str, object] = field(default_factory=dict)

    def to(self, device: torch.device) -> Workload:
        """The same workload with module, inputs and targets on ``device``."""
        move = (lambda v: tuple(t.to(device) for t in v)) if isinstance(self.inputs, tuple) else \
            (lambda v: v.to(device))
        return Workload(self.name, self.module.to(device), move(self.inputs), self.targets.to(device),
                        self.loss_fn, self.balance, self.info)


def mse(output: object, target: object) -> Tensor:
    return F.mse_loss(output, target)  # type: ignore[arg-type]


def cross_entropy(output: object, target: object) -> Tensor:
    return F.cross_entropy(output, target)  # type: ignore[arg-type]


def token_loss(output: object, target: object) -> Tensor:
    return token_cross_entropy(output, target)  # type: ignore[arg-type]


def mlp_module(width: int, hidden: int, blocks: int = 8) -> nn.Sequential:
    """``blocks`` × (Linear width→hidden, GELU, Linear hidden→width), flat."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def make_workload(name: str, sizes: Sizes, partitions: int = 2, seed: int = 0) -> Workload:
    """Build workload ``name`` ("mlp", "transformer", "amoebanet", "tiny") at ``sizes``.

    Raises:
        ValueError: unknown name.
    """
    torch.manual_seed(seed)
    smoke = sizes.name == "smoke"
    if name == "mlp":
        width, hidden = sizes.mlp_hidden
        module = mlp_module(width, hidden)
        x, y = torch.randn(sizes.mlp_batch, width), torch.randn(sizes.mlp_batch, width)
        return Workload(name, module, x, y, mse, [12, 12], {"batch": sizes.mlp_batch, "width": width,
                                                             "hidden": hidden, "blocks": 8})
    if name == "tiny":  # scheduling overhead: almost no compute per action
        module = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        batch = sizes.overhead_microbatches
        return Workload(name, module, torch.randn(batch, 4), torch.randn(batch, 4), mse, [2, 2],
                        {"batch": batch})
    if name == "transformer":
        opts = {} if smoke else dict(num_layers=3, d_model=128, ffn_dim=512, num_heads=4, vocab_size=256)
        seq, batch = (8, 8) if smoke else (32, 64)
        module = build("transformer_tiny", seq_len=seq, **opts)
        vocab = module.spec.options["vocab_size"]
        src = torch.randint(4, vocab, (batch, seq))
        tgt = torch.randint(4, vocab, (batch, seq + 1))
        balance = balance_by_cost(layer_costs(module, "flops"), partitions)
        return Workload(name, module, (src, tgt[:, :-1].contiguous()), tgt[:, 1:].contiguous(), token_loss,
                        balance, {"batch": batch, "seq_len": seq, **module.spec.options})
    if name == "amoebanet":
        opts = dict(num_layers=3, num_filters=8 if smoke else 16, image_size=16 if smoke else 32)
        batch = 8 if smoke else 64
        module = build("amoebanet_d_tiny", **opts)
        x = torch.randn(batch, 3, opts["image_size"], opts["image_size"])
        y = torch.randint(0, 10, (batch,))
        balance = balance_by_cost(layer_costs(module, "flops"), partitions)
        return Workload(name, module, x, y, cross_entropy, balance, {"batch": batch, **opts})
    raise ValueError(f"unknown workload {name!r}; known: mlp, transformer, amoebanet, tiny")


def robust_time(fn: Callable[[], object], repeats: int, warmup: int,
                between: Callable[[], object] | None = None) -> dict[str, float]:
    """Median, min and max seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs.

    ``between`` (e.g. zeroing gradients) runs before each call, outside the timing.
    """
    times = []
    for i in range(warmup + max(1, repeats)):
        if between is not None:
            between()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def alternating_medians(fns: dict[str, Callable[[], object]], rounds: int,
                        between: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of each function, timed in alternating rounds (order flipped every round).

    The first round is a warm-up. ``between`` (e.g. zeroing gradients) runs before each
    call, outside the timing. Alternation makes the ratios robust to the machine's drift.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(max(2, rounds)):
        for name in names if r % 2 == 0 else names[::-1]:
            if between is not None:
                between()
            start = time.perf_counter()
            fns[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def prepare_process() -> bool:
    """Give every contender in this process the engine's allocator setting; returns whether it applies.

    ``GPipe`` / ``DistributedGPipe`` make glibc keep freed memory (``retain_freed_memory``,
    process-wide). Setting it before anything is timed gives the unpipelined baseline and
    torch.distributed.pipelining the same allocator, so the comparison is of the engines.
    """
    return retain_freed_memory()


def load_average() -> list[float]:
    """The 1/5/15-minute load averages (empty where the OS has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def machine_info(device: str) -> dict[str, object]:
    """CPU model, cores, torch version, device and current load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, object] = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
                               "python": platform.python_version(), "device": device,
                               "load_average": load_average()}
    if device == "cuda" and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def sync(device: str) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()

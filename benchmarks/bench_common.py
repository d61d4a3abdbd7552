"""What every benchmark shares: run sizes, the workloads at those sizes, the process's setup.

The workloads themselves (``gpipe_lab.planner.workload``, ``gpipe_lab.bench.workloads``) are built afresh from the same seed
by every benchmark, so the pipelined, unpipelined and torch.distributed.pipelining
runs train the same model on the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpipe_lab.bench import mlp
from gpipe_lab.pipeline import retain_freed_memory
from gpipe_lab.planner.workload import Workload, WorkloadSpec, tiny_linear

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
    yardstick_mlp_batch: int = 512  # the MLP's batch against plain gradient accumulation (issue 28's table)
    transformer_dropout: float = 0.0  # the Transformer's dropout (0.1 in the replay-cost row)
    memory_checkpoints: tuple[str, ...] = CHECKPOINTS  # modes whose saved-activation peaks are counted
    ceiling_microbatches: tuple[int, ...] | None = None  # M with the machine-ceiling runs (None: torch's M)


SIZES = {
    "smoke": Sizes("smoke", 64, (32, 64), (1, 4), (2,), ("never", "always"), ("never",), (4,), 1, 0,
                   overhead_microbatches=8, yardstick_mlp_batch=64),
    # quick: the targets' rows only (M=4 is the yardstick's; the memory targets read never and always)
    "quick": Sizes("quick", 1024, (512, 2048), (8, 16), (8,), ("never", "always"), ("never",), (8, 16),
                   3, 1, recompute_microbatches=(8,), gloo_repeats=5, beyond_torch=("gpipe-bw",),
                   memory_checkpoints=("never", "always"), ceiling_microbatches=(8,)),
    "full": Sizes("full", 1024, (512, 2048), (1, 2, 4, 8, 16, 32), (1, 2, 4, 8, 16, 32), CHECKPOINTS,
                  CHECKPOINTS, (2, 4, 8, 16, 32), 5, 2, overhead_microbatches=128),
}


def make_workload(name: str, sizes: Sizes, partitions: int = 2, seed: int = 0) -> Workload:
    """Build workload ``name`` ("mlp", "transformer", "amoebanet", "tiny") at ``sizes``.

    Raises:
        ValueError: unknown name.
    """
    smoke = sizes.name == "smoke"
    if name == "mlp":
        width, hidden = sizes.mlp_hidden
        return mlp(sizes.mlp_batch, width, hidden, partitions=partitions, seed=seed)
    if name == "tiny":
        return tiny_linear(sizes.overhead_microbatches, partitions=partitions, seed=seed)
    if name == "transformer":
        opts: dict[str, object] = {} if smoke else dict(num_layers=3, d_model=128, ffn_dim=512, num_heads=4,
                                                        vocab_size=256)
        if sizes.transformer_dropout:
            opts["dropout"] = sizes.transformer_dropout
        spec = WorkloadSpec(name, "transformer_tiny", {"seq_len": 8 if smoke else 32, **opts}, 8 if smoke else 64)
        return spec.build(partitions, seed)
    if name == "amoebanet":
        opts = dict(num_layers=3, num_filters=8 if smoke else 16, image_size=16 if smoke else 32)
        return WorkloadSpec(name, "amoebanet_d_tiny", opts, 8 if smoke else 64).build(partitions, seed)
    raise ValueError(f"unknown workload {name!r}; known: mlp, transformer, amoebanet, tiny")


def probe_mlp(argv: list[str]) -> tuple[int, int, Workload]:
    """A probe's start: ``[M] [rounds]`` from ``argv`` (default 8 and 7), the process prepared, one
    intra-op thread, and the quick MLP.

    Raises:
        ValueError: an argument that is not a whole number.
    """
    chunks = int(argv[0]) if argv else 8
    rounds = int(argv[1]) if len(argv) > 1 else 7
    prepare_process()
    torch.set_num_threads(1)
    return chunks, rounds, make_workload("mlp", SIZES["quick"])


def prepare_process() -> bool:
    """Give every contender in this process the engine's allocator setting; returns whether it applies.

    ``GPipe`` / ``DistributedGPipe`` make glibc keep freed memory (``retain_freed_memory``,
    process-wide). Setting it before anything is timed gives the unpipelined baseline and
    torch.distributed.pipelining the same allocator, so the comparison is of the engines.
    """
    return retain_freed_memory()


def sync(device: str) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()

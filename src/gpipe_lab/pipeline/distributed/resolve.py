"""Resolving the constructor's arguments: balance and K, device, a seed shared by all ranks."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from gpipe_lab.pipeline.devices.assignment import normalize_device
from gpipe_lab.pipeline.distributed.topology import Topology, check_world
from gpipe_lab.pipeline.options import OptionError, PipelineOptions
from gpipe_lab.pipeline.partitioning.partition import resolve_balance


def resolve_stages(module: nn.Sequential, options: PipelineOptions, data_parallel_size: int | None,
                   sample: Any = None) -> tuple[list[int], int]:
    """Layers per chunk (K·v entries, see ``partition.resolve_balance``: a measured cost on
    ``sample``) and K.

    Without ``balance`` or ``partitions``, K = world size / ``data_parallel_size``.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: inconsistent numbers, or a world size K does not divide; messages name them.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("DistributedGPipe needs torch.distributed.init_process_group() first "
                           "(e.g. launch with torchrun)")
    world = dist.get_world_size()
    default = None
    if data_parallel_size is not None and data_parallel_size >= 1 and world % data_parallel_size == 0:
        default = world // data_parallel_size
    if options.balance is None and options.partitions is None and default is None:
        raise ValueError(f"give balance=[...] or partitions=K (world size {world}, "
                         f"data_parallel_size {data_parallel_size})")
    balance = resolve_balance(module, options, default, sample)
    num_stages = len(balance) // options.virtual_stages
    check_world(world, num_stages)
    return balance, num_stages


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Default: ``cuda:<LOCAL_RANK>`` under the NCCL backend, else CPU; ``"cuda"`` gets an index.

    Raises:
        ValueError: a device that cannot be used here (see ``devices.normalize_device``),
            or, for the default, a ``LOCAL_RANK`` that is not an integer or has no GPU of
            its own (see ``local_rank_device``).
    """
    if device is not None:
        return normalize_device(device)
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return local_rank_device(os.environ.get("LOCAL_RANK", "0"), torch.cuda.device_count())
    return torch.device("cpu")


def stage_device(devices: list[str] | None, topo: Topology, local_rank: int | None = None,
                 local_world_size: int | None = None) -> str | None:
    """This rank's entry of ``pipeline.devices`` (``None`` without it: ``resolve_device``'s default).

    ``devices`` lists one replica's devices, one per stage. The replicas that share a node
    (from torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; one node when unset) are placed
    side by side: the node's replica r takes each CUDA entry shifted by r·K indices
    (``["cuda:0", "cuda:1"]`` with two replicas per node gives the second ``cuda:2`` and
    ``cuda:3``, the layout of ``cuda:<LOCAL_RANK>``), so no two ranks of a node share a GPU. A list of ``LOCAL_WORLD_SIZE`` entries gives each local rank its own device.
    CPU entries are shared freely.

    Raises:
        OptionError: ``devices`` has neither K nor ``LOCAL_WORLD_SIZE`` entries, or two ranks
            of this node would get the same GPU (both named).
    """
    if devices is None:
        return None
    K = topo.num_stages
    local = topo.rank if local_rank is None else local_rank
    per_node = topo.world_size if local_world_size is None else local_world_size
    if len(devices) == per_node and per_node != K:
        table = list(devices)
    elif len(devices) == K:
        base = topo.rank - local  # this node's first global rank
        table = [_shifted(devices[(base + r) % K], ((base + r) // K - base // K) * K) for r in range(per_node)]
    else:
        raise OptionError(f"devices: {devices} has {len(devices)} entries for {K} pipeline stages; give "
                          f"one per stage ({K}), or one per process of this node ({per_node}), "
                          "or device= for this rank")
    seen: dict[str, int] = {}
    for r, name in enumerate(table):
        if name.startswith("cuda") and name in seen:
            raise OptionError(f"devices: {devices} puts local ranks {seen[name]} and {r} both on {name}; "
                              "NCCL needs one GPU per rank")
        seen.setdefault(name, r)
    return table[local]


def local_placement() -> tuple[int | None, int | None]:
    """This process's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun sets them (``None``: unset)."""
    values = []
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        text = os.environ.get(key)
        try:
            values.append(None if text is None else int(text))
        except ValueError:
            raise ValueError(f"{key}={text!r} is not an integer (set by torchrun)") from None
    return values[0], values[1]


def _shifted(device: str, offset: int) -> str:
    """``device`` with its CUDA index moved up by ``offset`` (other devices as they are)."""
    resolved = torch.device(device)
    if resolved.type != "cuda" or offset == 0:
        return device
    return f"cuda:{(resolved.index or 0) + offset}"


def local_rank_device(local_rank: str, device_count: int) -> torch.device:
    """``cuda:<LOCAL_RANK>``, refused when two ranks of this node would share a GPU.

    NCCL does not support two ranks of one communicator on one GPU (wrapping
    ``LOCAL_RANK`` around the device count would do that), so more processes per
    node than visible GPUs is an error, not a silent sharing.

    Raises:
        ValueError: ``local_rank`` is not an integer >= 0, or not below ``device_count``.
    """
    try:
        rank = int(local_rank)
    except ValueError:
        rank = -1
    if rank < 0:
        raise ValueError(f"LOCAL_RANK={local_rank!r} is not an integer >= 0 (set by torchrun)")
    if rank >= device_count:
        raise ValueError(f"LOCAL_RANK={rank} but this process sees {device_count} CUDA device(s): two NCCL "
                         f"ranks cannot share one GPU. Start at most {device_count} processes per node "
                         f"(torchrun --nproc-per-node={device_count}), or, where a launcher gives each "
                         "process its own GPU via CUDA_VISIBLE_DEVICES, pass device='cuda' explicitly")
    return torch.device("cuda", rank)


class DeviceId(TypedDict, total=False):
    """``init_process_group``'s keyword for the device (absent: no device bound)."""

    device_id: torch.device


def process_group_device(backend: str) -> DeviceId:
    """``init_process_group``'s ``device_id=`` under NCCL (``cuda:<LOCAL_RANK>``); nothing otherwise.

    With the device bound at start-up NCCL creates the world's communicator at once, on this
    rank's GPU, instead of guessing the GPU at the first collective.

    Raises:
        ValueError: a ``LOCAL_RANK`` without a GPU of its own (see ``local_rank_device``).
    """
    if backend != "nccl" or not torch.cuda.is_available():
        return {}
    return {"device_id": local_rank_device(os.environ.get("LOCAL_RANK", "0"), torch.cuda.device_count())}


def bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for other devices).

    The main thread runs the per-step collectives (barrier, verdict, timeline
    gather); without this they would all run on ``cuda:0`` whatever the rank.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


def to_cpu(value: object) -> object:
    """``value`` with every tensor copied to the CPU, so it can be pickled to another process.

    A pickled CUDA tensor unpickles onto the sender's GPU index, which the
    receiver may not have; CPU tensors travel anywhere.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def shared_seed(seed: int | None, device: torch.device) -> int:
    """The given seed, or rank 0's ``torch.initial_seed()`` broadcast to every rank."""
    if seed is not None:
        return int(seed)
    value = torch.tensor([torch.initial_seed() & ((1 << 62) - 1)], dtype=torch.int64,
                         device=device if device.type == "cuda" else "cpu")
    dist.broadcast(value, src=0)
    return int(value.item())


def agreed_balance(balance: list[int], device: torch.device) -> list[int]:
    """Rank 0's balance on every rank (collective over the world group).

    A balance from measured costs (``cost="time"``, a callable that times) may differ between
    ranks; the stages must cut the module at the same layers. Every rank's list has K·v entries
    (K and v come from the options, the same everywhere), so only the counts travel.
    """
    value = torch.tensor(balance, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.broadcast(value, src=0)
    return [int(n) for n in value.tolist()]


#: seconds the process group waits for a collective before NCCL's watchdog ends the rank
PROCESS_GROUP_TIMEOUT = 120.0


def nccl_failure_settings(timeout: float = PROCESS_GROUP_TIMEOUT) -> timedelta:
    """Call before ``init_process_group``: NCCL errors end the rank, and the group's timeout.

    With asynchronous error handling NCCL's watchdog aborts a communicator whose
    operation failed or ran past the process-group timeout, and the rank ends
    with an error naming the operation, instead of hanging. The engine's own
    waits (``failure.wait_works``, shorter: ``timeout=`` of the pipeline) name
    the peer first; this is the backstop for a hang inside NCCL itself.
    Returns the timeout to pass to ``init_process_group(timeout=...)``.
    """
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return timedelta(seconds=timeout)

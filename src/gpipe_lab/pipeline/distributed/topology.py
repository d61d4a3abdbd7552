"""Where each rank sits in the D × K grid, and the process groups that connect them.

Layout: a pipeline is K CONSECUTIVE global ranks; replica ``d`` holds ranks
``d·K .. d·K+K-1`` and rank ``r`` runs stage ``r mod K`` of replica ``r // K``::

    K=2, D=3     stage 0   stage 1
    replica 0    rank 0    rank 1       pipeline group: one row
    replica 1    rank 2    rank 3       data-parallel group: one column
    replica 2    rank 4    rank 5

With ``--nproc-per-node`` a multiple of K, the activation/gradient traffic of a
pipeline stays inside one node (NVLink, shared memory) and only the gradient
all-reduce of the data-parallel groups crosses nodes.

Point-to-point traffic goes over *link groups*: one two-rank group per
(sender, receiver, kind) edge. Each link then carries messages in one
direction only, in the order both ends compute from the schedule, so NCCL's
in-order matching and per-pair streams cannot cross a send with a receive.

Every group is made once per world (``_group``) and reused by each later
pipeline of the process: a process group holds native threads and sockets until
the world ends, so a process that builds pipeline after pipeline (a sweep run
in one process, a rebuilt evaluation pipe) would otherwise gain a dozen threads
with each. Pipelines of one process therefore share their groups: step them one
at a time, not from two threads at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist

LinkKey = tuple[str, int, int]  # (kind "act" | "grad", source rank, destination rank): global ranks

#: the groups ``_group`` made, by (role, ranks, backend), and the world they belong to
_made: dict[tuple[tuple[str | int, ...], tuple[int, ...], str | None], object] = {}
_made_in: list[object] = []


def _group(role: tuple[str | int, ...], ranks: list[int], backend: str | None = None) -> object:
    """``dist.new_group(ranks, backend=backend)`` for ``role`` (e.g. ``("act", 0, 1)``: two links between
    the same ranks are two groups), made once per world and then reused.

    Collective like ``new_group``: every rank asks for every group in the same order, so a group
    is made by all ranks or reused by all. A new world (``destroy_process_group`` then
    ``init_process_group``) starts a new set.
    """
    world = dist.group.WORLD
    if not _made_in or _made_in[0] is not world:
        _made.clear()
        _made_in[:] = [world]
    key = (role, tuple(ranks), backend)
    if key not in _made:
        _made[key] = dist.new_group(list(ranks), backend=backend)
    return _made[key]


@dataclass
class Topology:
    """This rank's coordinates and every process group it takes part in."""

    world_size: int
    rank: int
    num_stages: int
    virtual_stages: int = 1
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    links: dict[LinkKey, dist.ProcessGroup] = field(default_factory=dict)
    #: the group each link's headers travel on (a CPU group under NCCL; else the link itself)
    header_links: dict[LinkKey, dist.ProcessGroup] = field(default_factory=dict)
    #: the links warmed with a send/receive pair before the first step, in the order warmed
    warmed: list[LinkKey] = field(default_factory=list)
    #: the pipeline rank of each virtual stage (the schedule's placement; empty: stage s on s mod K)
    placement: tuple[int, ...] = ()

    @property
    def dp_size(self) -> int:
        return self.world_size // self.num_stages

    @property
    def dp_rank(self) -> int:
        return self.rank // self.num_stages

    @property
    def stage_index(self) -> int:
        return self.rank % self.num_stages

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, stage order."""
        base = self.dp_rank * self.num_stages
        return list(range(base, base + self.num_stages))

    def rank_of(self, virtual_stage: int) -> int:
        """Global rank that runs a virtual stage (chunk) of this rank's pipeline."""
        if self.placement:
            return self.pp_ranks[self.placement[virtual_stage]]
        return self.pp_ranks[virtual_stage % self.num_stages]

    @property
    def chunk_ids(self) -> list[int]:
        """The virtual stages this rank holds, in stage order."""
        return [s for s in range(self.num_stages * self.virtual_stages) if self.rank_of(s) == self.rank]

    @property
    def last_rank(self) -> int:
        return self.rank_of(self.num_stages * self.virtual_stages - 1)


def check_world(world_size: int, num_stages: int, *, what: str | None = None,
                stages: str = "the number of pipeline stages K", fix: str | None = None) -> None:
    """The one rule for the distributed transport's world size: a multiple of K (one process per
    stage of each data-parallel replica). Front doors name their own keys in ``what`` (where the
    world size came from), ``stages`` (where K came from) and ``fix``.

    Raises:
        ValueError: ``num_stages`` below 1, or the world size is not a multiple of it.
    """
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    if world_size % num_stages != 0:
        fix = fix or f"the world size must be data_parallel_size × {num_stages}"
        raise ValueError(f"{what or f'world size {world_size}'} is not divisible by {stages}={num_stages}: "
                         f"the distributed transport runs one process per stage of each data-parallel "
                         f"replica; {fix}")


def _edges(num_stages: int, virtual_stages: int, placement: Sequence[int] = ()) -> list[tuple[str, int, int]]:
    """Rank-level edges (kind, from pipeline rank, to pipeline rank) a replica needs: one per pair of
    neighbouring stages on two ranks (``placement``, default stage s on rank s mod K)."""
    K = num_stages
    rank = list(placement) or [s % K for s in range(K * virtual_stages)]
    edges: list[tuple[str, int, int]] = []
    for k in range(K):  # in rank order, so that every rank asks for the groups in one order
        for s in range(len(rank) - 1):
            a, b = rank[s], rank[s + 1]
            if a != b and k == a:
                edges.append(("act", a, b))
            if a != b and k == b:
                edges.append(("grad", b, a))
    return list(dict.fromkeys(edges))


def build_topology(num_stages: int, virtual_stages: int = 1, data_parallel_size: int | None = None,
                   placement: Sequence[int] = ()) -> Topology:
    """Create (or reuse: ``_group``) the pipeline, data-parallel and link groups (collective: every
    rank calls it). ``placement``: the pipeline rank of each virtual stage (default s mod K).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: world size not divisible by ``num_stages``, or not equal to
            ``data_parallel_size × num_stages`` when a data-parallel size is given.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("DistributedGPipe needs torch.distributed.init_process_group() first "
                           "(e.g. launch with torchrun)")
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world(world, num_stages)
    if data_parallel_size is not None and data_parallel_size * num_stages != world:
        raise ValueError(f"data_parallel_size {data_parallel_size} × {num_stages} stages = "
                         f"{data_parallel_size * num_stages}, but the world size is {world}")
    topo = Topology(world, rank, num_stages, virtual_stages, placement=tuple(placement))
    D = world // num_stages
    for d in range(D):  # every rank creates every group, in the same order
        group = _group(("pipeline",), list(range(d * num_stages, (d + 1) * num_stages)))
        if d == topo.dp_rank:
            topo.pp_group = cast("dist.ProcessGroup", group)  # a group of this rank's
    for k in range(num_stages):
        group = _group(("data",), list(range(k, world, num_stages)))
        if k == topo.stage_index:
            topo.dp_group = cast("dist.ProcessGroup", group)
    add_links(topo, _edges(num_stages, virtual_stages, placement))
    return topo


def add_links(topo: Topology, edges: list[tuple[str, int, int]]) -> None:
    """Make the link groups of ``edges`` (kind, from pipeline rank, to pipeline rank) in every replica (collective:
    every rank calls it with the same edges, as ``build_topology`` does with a pipeline's own)."""
    nccl = dist.get_backend() == "nccl"
    K = topo.num_stages
    for d in range(topo.world_size // K):
        for kind, src, dst in edges:
            a, b = d * K + src, d * K + dst
            group = _group((kind, a, b), sorted((a, b)))
            # NCCL moves device tensors only: headers travel over a CPU (gloo) group of their own,
            # so reading one never waits for the device
            header = _group((kind, a, b), sorted((a, b)), backend="gloo") if nccl else group
            if topo.rank in (a, b):
                topo.links[(kind, a, b)] = cast("dist.ProcessGroup", group)
                topo.header_links[(kind, a, b)] = cast("dist.ProcessGroup", header)


def connect_links(topo: Topology, device: torch.device) -> list[LinkKey]:
    """Warm every link of this rank with a real send/receive pair now, not inside the first step.

    NCCL builds a separate two-rank communicator for point-to-point traffic, lazily, at a
    group's first send or receive; made inside step 1 it would be set up from several
    threads while kernels are in flight. Here each rank walks its links in one global order
    (sorted link keys), source sending one element to destination, blocking: the earliest
    unfinished link always has both ends waiting on it, so the pairs can never wait on each
    other in a cycle. The same pairs run on gloo (cheap, and they check the links).
    Returns the links warmed, in order (``topo.warmed`` keeps them).
    """
    on = device if device.type == "cuda" and dist.get_backend() == "nccl" else torch.device("cpu")
    warmed: list[LinkKey] = []
    for key in sorted(topo.links):
        _, src, dst = key
        probe = torch.full((1,), float(src), device=on)
        if topo.rank == src:
            dist.send(probe, dst=dst, group=topo.links[key])
        else:
            dist.recv(probe, src=src, group=topo.links[key])
            if int(probe.item()) != src:
                raise RuntimeError(f"link {key}: the warm-up message came from rank {int(probe.item())}")
        warmed.append(key)
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    topo.warmed = warmed
    return warmed


def connect_groups(topo: Topology, device: torch.device) -> None:
    """Create the pipeline and data-parallel groups' communicators now, bound to ``device``.

    NCCL makes a group's communicator at the group's first collective: the data-parallel one
    would be made inside step 1's backward (the first gradient bucket's all-reduce, from a stage
    thread, with kernels in flight). One one-element all-reduce over each group here, on this
    rank's GPU, makes both before step 1 on the right device. Collective: every rank calls it
    (its pipeline group first, then its data-parallel group, so no two ranks wait on each other).
    """
    on = device if device.type == "cuda" and dist.get_backend() == "nccl" else torch.device("cpu")
    for group in (topo.pp_group, topo.dp_group):
        dist.all_reduce(torch.zeros(1, device=on), group=group)
    if on.type == "cuda":
        torch.cuda.synchronize(on)


def barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """``dist.barrier`` over ``group``, naming this rank's GPU under NCCL (without ``device_ids``
    NCCL guesses the device from the rank, which is wrong when ranks do not map to ``cuda:<rank>``)."""
    cuda = device.type == "cuda" and dist.get_backend() == "nccl"
    dist.barrier(group=group, device_ids=[device.index] if cuda else None)

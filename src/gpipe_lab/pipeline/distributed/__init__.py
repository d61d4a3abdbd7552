"""The distributed transport: one pipeline stage per process over torch.distributed.

``DistributedGPipe`` runs the same schedule lists and ``StageRuntime`` as the
local ``GPipe``, with D data-parallel replicas of a K-stage pipeline
(world size D·K), variable boundary shapes, overlapped communication,
interleaved virtual stages and bounded failure. See docs/distributed.md.
"""

from gpipe_lab.pipeline.distributed.distributed_gpipe import DistributedGPipe
from gpipe_lab.pipeline.distributed.failure import GroupUnusableError, PeerFailedError, PeerTimeoutError
from gpipe_lab.pipeline.distributed.topology import Topology, build_topology
from gpipe_lab.pipeline.partitioning.materialize import seeded_init

__all__ = ["DistributedGPipe", "GroupUnusableError", "PeerFailedError", "PeerTimeoutError", "Topology", "build_topology",
           "seeded_init"]

"""Data parallelism: average each stage's gradients over its D replicas, in buckets.

As soon as a chunk's last backward (or weight-gradient) action ends, its
gradients are flattened into buckets of about ``bucket_bytes`` (25 MB by
default, one dtype and device per bucket) and an asynchronous all-reduce of
each bucket starts on the stage's data-parallel group; the remaining actions
of the step run meanwhile. ``finish`` waits, divides by D and copies back.

Every replica must produce gradients for the same parameters (a parameter
whose ``.grad`` is ``None`` is skipped), as with ``DistributedDataParallel``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe_lab.pipeline.distributed.failure import AbortChannel, wait_works

BUCKET_BYTES = 25 * 1024 * 1024
WHAT = "averaging gradients over data-parallel replicas"


def buckets(params: Iterable[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """Group parameters with gradients into buckets of one dtype/device, ~``bucket_bytes`` each."""
    groups: list[list[nn.Parameter]] = []
    open_bucket: dict[tuple, tuple[list[nn.Parameter], list[int]]] = {}
    for p in params:
        if p.grad is None:
            continue
        key = (p.grad.dtype, p.grad.device)
        bucket, size = open_bucket.setdefault(key, ([], [0]))
        bucket.append(p)
        size[0] += p.grad.numel() * p.grad.element_size()
        if size[0] >= bucket_bytes:
            groups.append(bucket)
            del open_bucket[key]
    groups.extend(bucket for bucket, _ in open_bucket.values())
    return groups


class GradientSync:
    """Bucketed, overlapped all-reduce (mean) of gradients over a data-parallel group."""

    def __init__(self, group: object, size: int, abort: AbortChannel, timeout: float,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.size = size
        self.abort = abort
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self.peers = [r for r in dist.get_process_group_ranks(group) if r != abort.rank] if size > 1 else []
        self._pending: list[tuple[object, Tensor, list[nn.Parameter]]] = []
        self._abandoned: list[tuple[object, Tensor, list[nn.Parameter]]] = []

    def start(self, params: Iterable[nn.Parameter]) -> None:
        """Launch the asynchronous all-reduce of these parameters' gradients (no-op when D = 1).

        Raises:
            PeerFailedError: a replica went away before the all-reduce could start (naming it).
        """
        if self.size == 1:
            return
        for bucket in buckets(params, self.bucket_bytes):
            flat = _flatten_dense_tensors([p.grad for p in bucket])
            try:
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            except RuntimeError as exc:  # a replica's connection is already closed
                raise self.abort.explain(WHAT, self.peers, exc, self.abort.where(WHAT)) from exc
            self._pending.append((work, flat, bucket))

    def finish(self) -> None:
        """Wait for every started all-reduce and write the averages back into ``.grad``.

        Raises:
            PeerFailedError: a replica failed or went away (naming it, and this rank's stage).
            PeerTimeoutError: a replica did not answer within the timeout.
        """
        pending, self._pending = self._pending, []
        wait_works([w for w, _, _ in pending], WHAT, self.peers, self.timeout, self.abort)
        for _, flat, bucket in pending:
            flat.div_(self.size)
            grads = [p.grad for p in bucket]
            torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))  # one launch per bucket

    def discard(self) -> None:
        """Forget in-flight buckets after a failure (their Work objects stay referenced here)."""
        self._abandoned.extend(self._pending)
        self._pending = []

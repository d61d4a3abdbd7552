"""Data parallelism: average each stage's gradients over its D replicas, in buckets.

As in ``DistributedDataParallel``, a chunk's parameters are grouped, in reverse
order (the order backward produces their gradients), into buckets of about
``bucket_bytes`` (25 MB by default, one dtype and device per bucket). Before a
step, ``arm`` tells each chunk how many backward accumulations complete its
gradients (its number of ``B`` actions); a hook after each gradient
accumulation counts them, and the moment every parameter of a bucket has all
of its accumulations, that bucket's asynchronous all-reduce starts, while the
backward of the last micro-batch is still running through earlier layers.
After the chunk's last backward action ``start`` launches whatever is left (a
bucket with a parameter that got no gradient, a schedule whose weight
gradients come in ``W`` actions). ``finish`` waits, divides by D and copies back.

Every replica must produce gradients for the same parameters (a parameter
whose ``.grad`` is ``None`` is skipped), as with ``DistributedDataParallel``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe_lab.pipeline.distributed.failure import AbortChannel, wait_works

BUCKET_BYTES = 25 * 1024 * 1024
WHAT = "averaging gradients over data-parallel replicas"


def layout(params: Sequence[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """Buckets of the trainable parameters, in reverse order, one dtype/device each, ~``bucket_bytes``.

    The same on every replica: it depends on the parameters, never on which have a gradient.
    """
    groups: list[list[nn.Parameter]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[nn.Parameter], list[int]]] = {}
    for p in reversed([p for p in params if p.requires_grad]):
        bucket, size = open_bucket.setdefault((p.dtype, p.device), ([], [0]))
        bucket.append(p)
        size[0] += p.numel() * p.element_size()
        if size[0] >= bucket_bytes:
            groups.append(bucket)
            del open_bucket[(p.dtype, p.device)]
    groups.extend(bucket for bucket, _ in open_bucket.values())
    return groups


class _Armed:
    """One bucket during one step: how many accumulations each parameter still needs."""

    __slots__ = ("params", "left", "waiting", "launched")

    def __init__(self, params: list[nn.Parameter], accumulations: int) -> None:
        self.params = params
        self.left = {id(p): accumulations for p in params}
        self.waiting = len(params)
        self.launched = False

    def accumulated(self, p: Tensor) -> bool:
        """Count one accumulation of ``p``; True when the whole bucket is complete."""
        left = self.left[id(p)] - 1
        self.left[id(p)] = left
        if left == 0:
            self.waiting -= 1
        return self.waiting == 0


def buckets(params: Iterable[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """Group parameters with gradients into buckets of one dtype/device, ~``bucket_bytes`` each."""
    groups: list[list[nn.Parameter]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[nn.Parameter], list[int]]] = {}
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
    """Bucketed all-reduce (mean) of gradients over a data-parallel group, overlapping the backward."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, abort: AbortChannel, timeout: float,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.size = size
        self.abort = abort
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self.peers = [r for r in dist.get_process_group_ranks(group) if r != abort.rank] if size > 1 else []
        self._pending: list[tuple[dist.Work, Tensor, list[nn.Parameter]]] = []
        self._abandoned: list[tuple[dist.Work, Tensor, list[nn.Parameter]]] = []
        self._layouts: dict[int, list[list[nn.Parameter]]] = {}
        self._hooked: set[int] = set()
        self._armed: dict[int, _Armed] = {}  # id(parameter) -> its bucket, this step
        #: buckets launched by the accumulation hooks, i.e. during a backward (cumulative)
        self.launched_in_backward = 0

    def arm(self, key: int, params: Sequence[nn.Parameter], accumulations: int) -> None:
        """Before a step: launch each bucket of chunk ``key`` once its parameters have had
        ``accumulations`` gradient accumulations (0: wait for ``start``; no-op when D = 1)."""
        if self.size == 1 or accumulations <= 0:
            return
        if key not in self._layouts:
            self._layouts[key] = layout(params, self.bucket_bytes)
        for bucket in self._layouts[key]:
            armed = _Armed(bucket, accumulations)
            for p in bucket:
                self._armed[id(p)] = armed
                if id(p) not in self._hooked:
                    p.register_post_accumulate_grad_hook(self._accumulated)  # type: ignore[no-untyped-call]  # unannotated in torch
                    self._hooked.add(id(p))

    def _accumulated(self, p: Tensor) -> None:
        armed = self._armed.get(id(p))
        if armed is not None and not armed.launched and armed.accumulated(p):
            self.launched_in_backward += 1
            self._launch(armed)

    def _launch(self, armed: _Armed) -> None:
        armed.launched = True
        present = [p for p in armed.params if p.grad is not None]
        if present:
            self._all_reduce(present)

    def _all_reduce(self, bucket: list[nn.Parameter]) -> None:
        flat = _flatten_dense_tensors([p.grad for p in bucket])
        try:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        except RuntimeError as exc:  # a replica's connection is already closed
            raise self.abort.explain(WHAT, self.peers, exc, self.abort.where(WHAT)) from exc
        self._pending.append((work, flat, bucket))

    def start(self, params: Iterable[nn.Parameter]) -> None:
        """Launch the all-reduce of these parameters' gradients not launched yet (no-op when D = 1).

        Raises:
            PeerFailedError: a replica went away before the all-reduce could start (naming it).
        """
        if self.size == 1:
            return
        params = list(params)
        rest = []
        for p in params:
            armed = self._armed.pop(id(p), None)
            if armed is None:
                rest.append(p)
            elif not armed.launched:
                self._launch(armed)
        for bucket in buckets(rest, self.bucket_bytes):
            self._all_reduce(bucket)

    def finish(self) -> None:
        """Wait for every started all-reduce and write the averages back into ``.grad``.

        Raises:
            PeerFailedError: a replica failed or went away (naming it, and this rank's stage).
            PeerTimeoutError: a replica did not answer within the timeout.
        """
        pending, self._pending = self._pending, []
        self._armed = {}
        wait_works([w for w, _, _ in pending], WHAT, self.peers, self.timeout, self.abort)
        for _, flat, bucket in pending:
            flat.div_(self.size)
            grads = cast("list[Tensor]", [p.grad for p in bucket])  # a bucket's parameters have gradients
            torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))  # one launch per bucket

    def discard(self) -> None:
        """Forget in-flight buckets after a failure (their Work objects stay referenced here)."""
        self._abandoned.extend(self._pending)
        self._pending = []
        self._armed = {}

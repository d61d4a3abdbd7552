"""GPU check sections on device behaviour: stage-to-stage copies on one GPU, and a leak check.

Each takes a ``Context`` (see gpu_check_engine) and returns its figures with
``status``. A dry run runs the same code at tiny sizes on the CPU, with the
host clock for device times and live tensors counted instead of device bytes.
"""

from __future__ import annotations

import copy
import gc
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu_check_engine import Context
from benchmarks.gpu_check_probes import busy_seconds, mlp_model, relative_gradient_error
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.devices.streams import Mark
from gpipe_lab.pipeline.measuring.device_timing import DeviceClock
from gpipe_lab.pipeline.measuring.step_timeline import Event

#: copies per hand-over: a link slower than one device-to-device copy
COPY_REPEATS = 4


class _EmulatedLink:
    """The pipe's streams, with each hand-over's values copied on the sender's copy stream
    (where a transfer to another GPU runs) and the copies handed over instead."""

    def __init__(self, inner: Any, on_gpu: bool) -> None:
        self.inner, self.on_gpu = inner, on_gpu
        self.spans: list[tuple[Any, Any]] = []  # (start, end): CUDA events, or host seconds on the CPU

    def compute(self, rank: int, device: torch.device) -> Any:
        return self.inner.compute(rank, device)

    def begin(self, ranks: Any) -> None:
        self.spans = []
        self.inner.begin(ranks)

    def finish(self, ranks: Any) -> None:
        self.inner.finish(ranks)

    def mark(self, rank: int, device: torch.device) -> Any:
        return self.inner.mark(rank, device)

    def _copies(self, values: Any) -> tuple[Any, ...]:
        out = []
        for v in values:
            moved = None if v is None else v.detach().clone()
            for _ in range(COPY_REPEATS - 1):
                moved = None if v is None else moved.copy_(v)
            out.append(moved if v is None or not v.requires_grad else moved.requires_grad_())
        return tuple(out)

    def hand_over(self, values: Any, mark: Any, rank: int, device: torch.device) -> Any:
        if not (self.on_gpu and device.type == "cuda" and mark is not None):
            start = time.perf_counter()
            moved = self._copies(values)
            self.spans.append((start, time.perf_counter()))
            return self.inner.hand_over(moved, mark, rank, device)
        # as between two GPUs: the copy runs on the SENDER's copy stream, after its compute
        copy_stream = self.inner.streams_of(mark.rank, mark.device)[1]
        copy_stream.wait_event(mark.event)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(copy_stream):
            start.record()
            moved = self._copies(values)
            end.record()
        for v in values:
            if v is not None:
                v.record_stream(copy_stream)  # the sender's tensor must outlive the copy
        self.spans.append((start, end))
        # the receiver's compute stream waits for the copy (not only for the sender's compute)
        return self.inner.hand_over(moved, Mark(end, mark.rank, mark.device), rank, device)

    def host_spans(self, device: torch.device) -> list[tuple[float, float]]:
        """The copies in host-clock seconds (anchored like the device timeline)."""
        if not self.on_gpu:
            return list(self.spans)
        anchor, anchor_host = DeviceClock(device).anchor()
        return [
            (anchor_host - s.elapsed_time(anchor) / 1e3, anchor_host - e.elapsed_time(anchor) / 1e3)
            for s, e in self.spans
        ]


def _overlap(spans: list[tuple[float, float]], events: list[Event]) -> float:
    """Seconds of ``spans`` during which some action computed."""
    total = 0.0
    for start, end in spans:
        inside = [
            Event(0, e.kind, 0, max(e.start, start), min(e.end, end))
            for e in events
            if e.kind != "wait" and e.end > start and e.start < end
        ]
        total += busy_seconds(inside)
    return total


def copy_overlap(ctx: Context) -> dict[str, Any]:
    """K=2 on one GPU, every hand-over copied on the copy stream: gradients exact, copy/compute overlap."""
    torch.backends.cuda.matmul.allow_tf32 = False
    on_gpu = ctx.device.type == "cuda"
    module = mlp_model(16 if ctx.dry else 2048, 4).to(ctx.device)
    ref, piped = copy.deepcopy(module), copy.deepcopy(module)
    x = torch.randn(32 if ctx.dry else 1024, module[0].in_features, device=ctx.device)
    F.mse_loss(ref(x), x).backward()
    pipe = GPipe(piped, partitions=2, chunks=8, devices=[ctx.device] * 2, checkpoint="never")
    link = pipe.channel.streams = _EmulatedLink(pipe.channel.streams, on_gpu)  # type: ignore[attr-defined]
    pipe.train_step(x, x, F.mse_loss)
    error = relative_gradient_error(ref, piped)
    spans = link.host_spans(ctx.device)
    events = pipe.timeline.on_device().events
    copy_seconds = sum(end - start for start, end in spans)
    overlapped = _overlap(spans, events)
    ok = error <= 1e-5 and len(spans) > 0
    return {
        "status": "PASS" if ok else "FAIL",
        "relative_gradient_error": error,
        "hand_overs": len(spans),
        "copy_seconds": round(copy_seconds, 6),
        "copy_overlapped_by_compute": round(overlapped, 6),
        "overlap_fraction": round(overlapped / max(copy_seconds, 1e-12), 3),
        "timing": "CUDA events" if on_gpu else "host clock (CPU, dry run)",
    }


def _live(ctx: Context) -> int:
    """Bytes allocated on the GPU, or (dry run) the number of live tensors."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        return torch.cuda.memory_allocated(ctx.device)
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def leak(ctx: Context) -> dict[str, Any]:
    """After two warm-up steps, what is allocated and what is reserved stay flat over three more."""
    module = mlp_model(16 if ctx.dry else 1024, 4).to(ctx.device)
    pipe = GPipe(module, partitions=2, chunks=4, devices=[ctx.device] * 2, checkpoint="except_last")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(32 if ctx.dry else 512, module[0].in_features, device=ctx.device)
    readings, reserved = [], []
    for step in range(5):
        pipe.train_step(x, x, F.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        if step >= 2:
            readings.append(_live(ctx))
            if ctx.device.type == "cuda":  # the caching allocator's pool: copy streams reuse their blocks
                reserved.append(torch.cuda.memory_reserved(ctx.device))
    flat = len(set(readings)) == 1 and len(set(reserved)) <= 1
    return {
        "status": "PASS" if flat else "FAIL",
        "flat": flat,
        "readings": readings,
        "reserved_bytes": reserved if ctx.device.type == "cuda" else "not measured (CPU, dry run)",
        "unit": "bytes (torch.cuda.memory_allocated)"
        if ctx.device.type == "cuda"
        else "live tensors (CPU, dry run)",
    }

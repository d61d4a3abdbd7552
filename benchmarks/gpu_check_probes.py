"""GPU check probes: ``pipe(x).backward()`` within 60 s, race amplification, launch-bound steps.

Each takes a ``Context`` (see gpu_check_engine) and returns its figures with
``status``. A dry run runs the same code at tiny sizes on the CPU: no sleep
kernel is queued there (the places where one would be are still counted) and
host times stand in for device times.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpu_check_engine import Context
from gpipe_lab.bench.workloads import mlp_module
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.step_timeline import Event
from gpipe_lab.pipeline.options import PipelineOptions

#: seconds ``pipe(x).backward()`` gets before the probe calls it a hang (its section's cap is 65 s)
BACKWARD_PROBE_SECONDS = 55.0
#: GPU clock cycles of each amplifying sleep (about a millisecond)
SLEEP_CYCLES = 2_000_000


def mlp_model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return mlp_module(width, 2 * width, blocks)


def relative_gradient_error(ref: nn.Module, piped: nn.Module) -> float:
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    worst = max(
        float((a.grad - b.grad.to(a.device)).abs().max())
        for a, b in zip(ref.parameters(), piped.parameters())
    )
    return worst / max(scale, 1.0)


def backward_probe(ctx: Context) -> dict[str, Any]:
    """``out = pipe(x); loss.backward()`` with two stages on one device returns, with the right gradients."""
    torch.backends.cuda.matmul.allow_tf32 = False
    module = mlp_model(16 if ctx.dry else 512, 2).to(ctx.device)
    ref, piped = copy.deepcopy(module), copy.deepcopy(module)
    x = torch.randn(16 if ctx.dry else 256, module[0].in_features, device=ctx.device)
    F.mse_loss(ref(x), x).backward()
    pipe = GPipe(piped, partitions=2, chunks=4, devices=[ctx.device] * 2, timeout=BACKWARD_PROBE_SECONDS)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            F.mse_loss(pipe(x), x).backward()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    start = time.perf_counter()
    worker = threading.Thread(target=run, name="backward-probe", daemon=True)
    worker.start()
    worker.join(BACKWARD_PROBE_SECONDS)
    seconds = round(time.perf_counter() - start, 3)
    if worker.is_alive():
        return {
            "status": "FAIL",
            "error": f"pipe(x).backward() did not return within {BACKWARD_PROBE_SECONDS} s "
            "(the autograd worker of the device waits on the stage threads)",
        }
    if failure:
        return {
            "status": "FAIL",
            "error": f"{type(failure[0]).__name__}: {failure[0]}",
            "seconds_to_return": seconds,
        }
    error = relative_gradient_error(ref, piped)
    return {
        "status": "PASS" if error <= 1e-5 else "FAIL",
        "seconds_to_return": seconds,
        "relative_gradient_error": error,
    }


class _Amplified:
    """The pipe's streams with a sleep queued on the sender's stream before each mark and on the
    receiver's copy stream before each hand-over: an ordering that is not enforced shows up."""

    def __init__(self, inner: Any, on_gpu: bool) -> None:
        self.inner, self.on_gpu, self.sleeps = inner, on_gpu, 0

    def _sleep(self) -> None:
        self.sleeps += 1
        if self.on_gpu:
            torch.cuda._sleep(SLEEP_CYCLES)

    def compute(self, rank: int, device: torch.device) -> Any:
        return self.inner.compute(rank, device)

    def begin(self, ranks: Any) -> None:
        self.inner.begin(ranks)

    def finish(self, ranks: Any) -> None:
        self.inner.finish(ranks)

    def mark(self, rank: int, device: torch.device) -> Any:
        self._sleep()  # the sender's current stream: its compute stream
        return self.inner.mark(rank, device)

    def hand_over(self, values: Any, mark: Any, rank: int, device: torch.device) -> Any:
        if self.on_gpu and device.type == "cuda" and mark is not None:
            copy_stream = self.inner.streams_of(mark.rank, mark.device)[1]  # where GPU-to-GPU copies run
            with torch.cuda.stream(copy_stream):
                self._sleep()
        else:
            self._sleep()
        return self.inner.hand_over(values, mark, rank, device)


def order_violations(events: list[Event]) -> list[str]:
    """Hand-offs that ran out of order: F(k,m) before F(k-1,m) ended, B(k-1,m) before B(k,m) ended."""
    at = {(e.stage, e.kind, e.microbatch): e for e in events}
    bad = []
    for (k, kind, m), e in at.items():
        if kind == "F" and (k - 1, "F", m) in at and e.start < at[(k - 1, "F", m)].end:
            bad.append(
                f"F({k},{m}) started {at[(k - 1, 'F', m)].end - e.start:.2e} s before F({k - 1},{m}) ended"
            )
        if kind == "B" and (k + 1, "B", m) in at and e.start < at[(k + 1, "B", m)].end:
            bad.append(
                f"B({k},{m}) started {at[(k + 1, 'B', m)].end - e.start:.2e} s before B({k + 1},{m}) ended"
            )
    return bad


def race(ctx: Context) -> dict[str, Any]:
    """A K=2 correctness subset with sleeps amplifying every race, then the hand-off order on the device."""
    torch.backends.cuda.matmul.allow_tf32 = False
    on_gpu = ctx.device.type == "cuda"
    failures: list[str] = []
    runs = sleeps = 0
    for schedule in ("gpipe", "1f1b"):
        for checkpoint in ("never", "always"):
            module = mlp_model(16 if ctx.dry else 1024, 2).to(ctx.device)
            ref, piped = copy.deepcopy(module), copy.deepcopy(module)
            x = torch.randn(16 if ctx.dry else 512, module[0].in_features, device=ctx.device)
            F.mse_loss(ref(x), x).backward()
            pipe = GPipe(
                piped,
                partitions=2,
                chunks=4,
                devices=[ctx.device] * 2,
                schedule=schedule,
                checkpoint=checkpoint,
            )
            amplified = pipe.channel.streams = _Amplified(pipe.channel.streams, on_gpu)  # type: ignore[attr-defined]
            pipe.train_step(x, x, F.mse_loss)
            runs, sleeps = runs + 1, sleeps + amplified.sleeps
            error = relative_gradient_error(ref, piped)
            if error > 1e-5:
                failures.append(f"{schedule}/{checkpoint}: gradient error {error:.2e}")
            failures += [
                f"{schedule}/{checkpoint}: {v}" for v in order_violations(pipe.timeline.on_device().events)
            ]
    ok = not failures and sleeps > 0
    return {
        "status": "PASS" if ok else "FAIL",
        "runs": runs,
        "amplifying_sleeps": sleeps,
        "sleep_kernels": on_gpu,
        "failures": failures[:20],
        "timing": "CUDA events" if on_gpu else "host clock (CPU, dry run)",
    }


def busy_seconds(events: list[Event]) -> float:
    """Seconds during which some action ran (the union of the compute intervals)."""
    spans = sorted((e.start, e.end) for e in events if e.kind != "wait")
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def launch_bound(ctx: Context) -> dict[str, Any]:
    """d=256, M=8 on one device: host seconds per step against device-busy seconds, features on and off."""
    width = 16 if ctx.dry else 256
    x = torch.randn(64 if ctx.dry else 256, width, device=ctx.device)
    variants = {
        "all on": {},
        "random_replay off": {"options": PipelineOptions(random_replay=False)},
        "track_memory off": {"track_memory": False},
        "nonfinite verdict off": {"nonfinite": "ignore"},
    }
    rows: dict[str, Any] = {}
    for label, options in variants.items():
        pipe = GPipe(
            mlp_model(width, 4).to(ctx.device), partitions=2, chunks=8, devices=[ctx.device] * 2, **options
        )
        pipe.train_step(x, x, F.mse_loss)
        host, busy = [], []
        for _ in range(3):
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            start = time.perf_counter()
            pipe.train_step(x, x, F.mse_loss)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            host.append(time.perf_counter() - start)
            busy.append(busy_seconds(pipe.timeline.on_device().events))
        h, b = sorted(host)[1], sorted(busy)[1]
        rows[label] = {
            "host_seconds_per_step": round(h, 5),
            "device_busy_seconds": round(b, 5),
            "host_over_busy": round(h / max(b, 1e-9), 2),
        }
    ok = all(r["device_busy_seconds"] > 0 for r in rows.values())
    return {
        "status": "PASS" if ok else "FAIL",
        "configs": rows,
        "timing": "CUDA events" if ctx.device.type == "cuda" else "host clock (CPU, dry run)",
    }

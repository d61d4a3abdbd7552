"""Device timing: CPU timelines are their own device timelines; GPU stages time actions with CUDA events."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.step_timeline import Event, Timeline


def test_a_cpu_step_has_no_device_clock() -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), partitions=2, chunks=2)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 2), nn.functional.mse_loss)
    assert all(s.clock is None for s in pipe.stages)
    assert pipe.timeline.on_device() is pipe.timeline


def test_a_gpu_stage_keeps_only_device_times_and_a_cpu_stage_its_host_waits() -> None:
    host = [Event(0, "F", 0, 1.0, 1.1), Event(0, "wait", 1, 1.1, 1.2), Event(1, "wait", 0, 1.0, 1.2),
            Event(1, "F", 0, 1.2, 1.3)]
    device = [Event(0, "F", 0, 1.05, 1.6)]
    t = Timeline(2, 1.0, 1.4, host, 1, device_source=lambda: device)
    on_device = t.on_device()
    # stage 0 is on a GPU: its host wait measured the host thread, not the device, so it is dropped
    assert [e for e in on_device.events if e.stage == 0] == device
    assert Event(1, "wait", 0, 1.0, 1.2) in on_device.events
    assert Event(1, "F", 0, 1.2, 1.3) in on_device.events
    assert on_device.waiting() == pytest.approx([0.0, 0.2])
    assert on_device.end == pytest.approx(1.6)  # the device finished after the host returned


class _FakeGpu:
    """A device whose clock reads host time + 1000 s, with work queued per stream."""

    OFFSET = 1000.0

    def __init__(self) -> None:
        self.host = 10.0

    def perf_counter(self) -> float:
        return self.host


class _FakeStream:
    def __init__(self, gpu: _FakeGpu) -> None:
        self.gpu, self.busy_until = gpu, 0.0  # host seconds at which the queued work ends

    def queue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, self.gpu.host) + seconds


class _FakeEvent:
    gpu: _FakeGpu

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.ran_at: float | None = None  # device clock

    def record(self, stream: _FakeStream) -> None:
        self.ran_at = max(stream.busy_until, self.gpu.host) + _FakeGpu.OFFSET

    def synchronize(self) -> None:
        assert self.ran_at is not None
        self.gpu.host = max(self.gpu.host, self.ran_at - _FakeGpu.OFFSET)

    def elapsed_time(self, other: _FakeEvent) -> float:
        assert self.ran_at is not None and other.ran_at is not None
        return (other.ran_at - self.ran_at) * 1e3


def test_device_times_are_anchored_when_an_event_runs_not_when_it_is_queued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream is still busy with 2 s of earlier work when the step's actions are queued."""
    from gpipe_lab.pipeline.measuring import device_timing

    gpu = _FakeGpu()
    compute = _FakeStream(gpu)
    _FakeEvent.gpu = gpu
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream(gpu))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: compute)
    monkeypatch.setattr(device_timing, "time", gpu)
    clock = device_timing.DeviceClock(torch.device("cuda", 0))
    compute.queue(2.0)  # the previous step: runs until host time 12
    clock.begin()
    start = clock.start()
    compute.queue(0.5)  # the forward's kernels, launched at host time 10
    clock.stop("F", (0,), start)
    gpu.host = 10.1  # the host returned from its launches long before the device ran them
    (forward,) = clock.resolve(stage=0)
    assert forward.start == pytest.approx(12.0) and forward.end == pytest.approx(12.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_actions_are_timed_on_the_device() -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2)), partitions=2, chunks=4,
                 devices=["cuda", "cuda"])
    pipe.train_step(torch.randn(64, 256), torch.randn(64, 2), nn.functional.mse_loss)
    device = pipe.timeline.on_device()
    kinds = {(e.stage, e.kind) for e in device.events}
    assert {(0, "F"), (1, "F"), (0, "B"), (1, "B")} <= kinds
    assert all(e.end >= e.start >= pipe.timeline.start for e in device.events)

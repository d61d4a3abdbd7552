"""Device timing: CPU timelines are their own device timelines; GPU stages time actions with CUDA events."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.timeline import Event, Timeline


def test_a_cpu_step_has_no_device_clock() -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), partitions=2, chunks=2)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 2), nn.functional.mse_loss)
    assert all(s.clock is None for s in pipe.stages)
    assert pipe.timeline.on_device() is pipe.timeline


def test_device_events_replace_the_host_times_of_the_same_actions() -> None:
    host = [Event(0, "F", 0, 1.0, 1.1), Event(0, "wait", 1, 1.1, 1.2), Event(1, "F", 0, 1.2, 1.3)]
    device = [Event(0, "F", 0, 1.05, 1.6)]
    t = Timeline(2, 1.0, 1.4, host, 1, device_source=lambda: device)
    on_device = t.on_device()
    assert Event(0, "F", 0, 1.0, 1.1) not in on_device.events and device[0] in on_device.events
    assert Event(0, "wait", 1, 1.1, 1.2) in on_device.events and Event(1, "F", 0, 1.2, 1.3) in on_device.events
    assert on_device.end == pytest.approx(1.6)  # the device finished after the host returned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_actions_are_timed_on_the_device() -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2)), partitions=2, chunks=4,
                 devices=["cuda", "cuda"])
    pipe.train_step(torch.randn(64, 256), torch.randn(64, 2), nn.functional.mse_loss)
    device = pipe.timeline.on_device()
    kinds = {(e.stage, e.kind) for e in device.events}
    assert {(0, "F"), (1, "F"), (0, "B"), (1, "B")} <= kinds
    assert all(e.end >= e.start >= pipe.timeline.start for e in device.events)

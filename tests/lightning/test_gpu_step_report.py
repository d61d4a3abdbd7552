"""The per-step report of a distributed run is one exchange, made only on the steps that log it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.lightning.callbacks import PipelineMetrics
from gpipe_lab.pipeline.distributed import DistributedGPipe
from helpers.strategy import TinyData, TinyRegressor, trainer


def test_the_engine_gathers_timeline_and_memory_in_one_exchange(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        pipe = DistributedGPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), partitions=1, chunks=2)
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 2), nn.functional.mse_loss)
        exchanges: list[object] = []
        gather = dist.all_gather_object
        monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, **kw: (exchanges.append(obj),
                                                                                gather(out, obj, **kw))[1])
        timeline, rows = pipe.gather_report()
        assert len(exchanges) == 1
        assert rows == pipe.memory() and len(timeline.events) == len(pipe.timeline.events)
    finally:
        dist.destroy_process_group()


def test_a_distributed_run_reports_only_the_steps_it_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 1..5 with log_every_n_steps=2: the first (pictured), 2, 4 and the last; a local run's
    report costs nothing and is made every step."""
    reported: dict[str, list[int]] = {}
    for transport in ("local", "distributed"):
        strategy = GPipeStrategy(partitions=2, chunks=2)
        kind = type(strategy)
        steps = reported.setdefault(transport, [])
        report = kind.step_report
        monkeypatch.setattr(kind, "transport", transport)  # the gate reads the transport's name only
        monkeypatch.setattr(kind, "step_report", lambda self, steps=steps, report=report: (
            steps.append(self.lightning_module.trainer.global_step), report(self))[1])
        metrics = PipelineMetrics(tmp_path / transport)
        trainer(strategy, max_steps=5, log_every_n_steps=2, callbacks=[metrics]).fit(TinyRegressor(), TinyData(n=80))
        monkeypatch.undo()
        assert len(metrics._rates) == 4  # the first step is warm-up, every later one is measured
    assert reported == {"local": [1, 2, 3, 4, 5], "distributed": [1, 2, 4, 5]}


def test_the_metrics_log_the_device_timeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, host times are launch times: the bubble and busy times come from
    ``Timeline.on_device`` (here a stand-in device timeline: 1 s, stage 1 idle for its first half)."""
    from gpipe_lab.pipeline.measuring.step_timeline import Event, Timeline

    def on_device(self: Timeline) -> Timeline:
        t0 = self.start
        return Timeline(2, t0, t0 + 1.0, [Event(0, "F", 0, t0, t0 + 0.5), Event(1, "F", 0, t0 + 0.5, t0 + 1.0)],
                        self.num_microbatches)

    monkeypatch.setattr(Timeline, "on_device", on_device)
    metrics = PipelineMetrics(tmp_path)
    trainer(GPipeStrategy(partitions=2, chunks=2), max_steps=3, log_every_n_steps=1,
            callbacks=[metrics]).fit(TinyRegressor(), TinyData(n=48))
    assert metrics.step_walls == [1.0, 1.0]  # the steps after the warm-up one, on the device's clock
    assert metrics._busy == [[0.5, 0.5]] * 2 and metrics._bubbles == [pytest.approx(0.5)] * 2

"""The strategies' CPU threads: the distributed ranks' default intra-op threads and the oversubscription
warning; the local transport's caller thread (optimizer step, data) sized by the free cores."""

from __future__ import annotations

import logging

import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy

from gpipe_lab.lightning import GPipeStrategy
from gpipe_lab.pipeline.devices import cpu_share


def _setup(monkeypatch, processes: int, cores: int, busy: float, **options) -> int:
    """Run the strategy's environment set-up of local rank 0 (the process group left out);
    the intra-op threads it chose."""
    monkeypatch.setattr(DDPStrategy, "setup_environment", lambda self: None)
    monkeypatch.setattr(cpu_share, "usable_cores", lambda: cores)
    monkeypatch.setattr(cpu_share, "busy_elsewhere", lambda: busy)
    monkeypatch.setattr(cpu_share, "_warned", False)
    strategy = GPipeStrategy(partitions=2, chunks=4, transport="distributed", **options)
    strategy.parallel_devices = [torch.device("cpu")] * processes
    before = torch.get_num_threads()
    try:
        strategy.setup_environment()
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_four_cpu_ranks_on_two_cores_get_one_thread_each_and_one_warning(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger=cpu_share.__name__):
        assert _setup(monkeypatch, 4, cores=2, busy=0.0) == 1
    warned = [r.getMessage() for r in caplog.records if r.name == cpu_share.__name__]
    assert len(warned) == 1 and warned[0].startswith("4 CPU stage(s) x 1 intra-op thread(s) exceed the 2 core(s) this")


def test_ranks_share_the_free_cores_and_stay_silent_when_they_fit(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger=cpu_share.__name__):
        assert _setup(monkeypatch, 2, cores=16, busy=0.0) == 8
        assert _setup(monkeypatch, 2, cores=16, busy=6.0) == 5
        assert _setup(monkeypatch, 2, cores=16, busy=6.0, threads_per_stage=3) == 3  # given: kept
    assert not [r for r in caplog.records if r.name == cpu_share.__name__]


def _local_setup(monkeypatch, cores: int, busy: float) -> int:
    """The local strategy's environment set-up on a CPU: the caller thread's intra-op threads."""
    monkeypatch.setattr(Strategy, "setup_environment", lambda self: None)
    monkeypatch.setattr(cpu_share, "usable_cores", lambda: cores)
    monkeypatch.setattr(cpu_share, "busy_elsewhere", lambda: busy)
    strategy = GPipeStrategy(partitions=2, chunks=4)
    strategy.parallel_devices = [torch.device("cpu")]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)  # torch's own default: every core
        strategy.setup_environment()
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_the_local_callers_thread_gets_the_free_cores_not_every_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _local_setup(monkeypatch, cores=2, busy=2.0) == 1  # two busy processes on two cores
    assert _local_setup(monkeypatch, cores=16, busy=6.0) == 10
    assert _local_setup(monkeypatch, cores=16, busy=0.0) == 16


def test_omp_num_threads_keeps_the_callers_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _local_setup(monkeypatch, cores=16, busy=6.0) == 16

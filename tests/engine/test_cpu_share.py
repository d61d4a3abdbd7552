"""The default intra-op threads of CPU stages: the free cores shared out, and the one-line warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch import nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.devices import cpu_share
from gpipe_lab.pipeline.devices.cpu_share import default_threads, free_cores, oversubscription


@pytest.mark.parametrize("cores,busy,stages,threads", [
    (2, 0.0, 1, 2),    # a quiet 2-core machine: K=1 takes both cores
    (2, 0.3, 1, 2),    # a little noise elsewhere leaves both
    (2, 0.7, 1, 1),    # most of a core taken: one thread
    (2, 1.0, 1, 1),    # beside one busy process
    (2, 2.0, 1, 1),    # beside two: still one, never zero
    (2, 0.0, 2, 1),    # K=2: one each
    (2, 0.0, 4, 1),    # more stages than cores: one each
    (16, 0.0, 2, 8),
    (16, 3.2, 2, 6),   # 13 free cores over 2 stages
    (16, 15.9, 2, 1),
])
def test_default_threads_share_out_the_free_cores(cores, busy, stages, threads):
    assert default_threads(stages, cores=cores, busy=busy) == threads


def test_no_sample_is_taken_where_the_answer_is_one_thread(monkeypatch):
    def refuse() -> float:
        raise AssertionError("sampled the load for a choice it cannot change")

    monkeypatch.setattr(cpu_share, "busy_elsewhere", refuse)
    assert default_threads(2, cores=2) == 1 and default_threads(3, cores=4) == 1


def test_stages_below_one_are_refused():
    with pytest.raises(ValueError, match="stages must be >= 1, got 0"):
        default_threads(0, cores=2, busy=0.0)


def test_free_cores_are_at_least_one_and_at_most_the_usable_ones():
    assert [free_cores(2, b) for b in (-1.0, 0.0, 0.49, 0.51, 1.6, 5.0)] == [2, 2, 2, 1, 1, 1]


@pytest.mark.parametrize("stages,threads,cores,busy,why", [
    (4, 1, 2, 0.0, "the 2 core(s) this process may use"),   # a 4-process distributed run on 2 cores
    (2, 1, 2, 0.0, None),    # K=2 of one thread each on 2 cores
    (2, 1, 2, 1.0, None),    # ... beside a busy process: single threads share the cores, no team collapses
    (1, 2, 2, 1.0, "the 1 free core(s) (2 usable, 1.0 busy elsewhere)"),  # K=1 of two threads beside it
    (1, 1, 2, 2.0, None),
    (2, 4, 16, 3.0, None),
    (2, 4, 16, 9.0, "the 7 free core(s) (16 usable, 9.0 busy elsewhere)"),
])
def test_oversubscription_is_named_when_stages_times_threads_exceed_the_cores(stages, threads, cores, busy, why):
    message = oversubscription(stages, threads, cores=cores, busy=busy)
    if why is None:
        assert message is None
        return
    assert message is not None and "\n" not in message
    assert message.startswith(f"{stages} CPU stage(s) x {threads} intra-op thread(s) exceed {why}: ")


def test_no_sample_is_taken_for_the_warning_of_single_threaded_stages(monkeypatch):
    def refuse() -> float:
        raise AssertionError("sampled the load for single-threaded stages")

    monkeypatch.setattr(cpu_share, "busy_elsewhere", refuse)
    assert oversubscription(2, 1, cores=2) is None and oversubscription(3, 1, cores=2) is not None


def test_the_load_sample_takes_this_process_out(monkeypatch):
    """Busy ticks of this process's cores over the sample, less this process's own CPU time."""
    clock = iter([0.0, 0.5, 0.6])  # start, end of sample, when stored
    monkeypatch.setattr(cpu_share, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda s: None))
    ticks = os.sysconf("SC_CLK_TCK")
    jiffies = iter([(0, 10 * ticks), (int(0.9 * ticks), 11 * ticks)])  # 0.9 s busy in 0.5 s of wall time
    own = iter([1.0, 1.3])  # this process used 0.3 s of it
    monkeypatch.setattr(cpu_share, "_cpu_jiffies", lambda cpus: next(jiffies))
    monkeypatch.setattr(cpu_share, "_own_cpu_s", lambda: next(own))
    monkeypatch.setattr(cpu_share, "_samples", {})
    assert cpu_share.busy_elsewhere() == pytest.approx((0.9 - 0.3) / 0.5)


def _tiny() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def test_gpipe_gives_one_cpu_stage_the_free_cores_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu_share, "usable_cores", lambda: 4)
    monkeypatch.setattr(cpu_share, "busy_elsewhere", lambda: 0.0)
    monkeypatch.setattr(cpu_share, "_warned", False)
    assert GPipe(_tiny(), balance=[2], chunks=2).threads_per_stage == 4
    monkeypatch.setattr(cpu_share, "busy_elsewhere", lambda: 2.8)
    assert GPipe(_tiny(), balance=[2], chunks=2).threads_per_stage == 1
    with caplog.at_level(logging.WARNING, logger=cpu_share.__name__):
        GPipe(_tiny(), balance=[2], chunks=2, threads_per_stage=3)  # 3 threads on 1 free core
        GPipe(_tiny(), balance=[1, 1], chunks=2, threads_per_stage=2)  # also too many: warned once only
    warned = [r.getMessage() for r in caplog.records if r.name == cpu_share.__name__]
    assert len(warned) == 1 and warned[0].startswith("1 CPU stage(s) x 3 intra-op thread(s) exceed the 1 free core")


BUSY = "import os, sys\nos.sched_setaffinity(0, {cpus})\nprint('spinning', flush=True)\nwhile True: pass\n"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.exists("/proc/stat"), reason="needs Linux and two usable cores")
def test_k1_beside_two_busy_processes_on_its_two_cores_takes_one_thread(monkeypatch):
    """End to end: this thread and two spinning processes pinned to the same two cores."""
    mask = os.sched_getaffinity(0)
    cores = set(sorted(mask)[:2])
    monkeypatch.setattr(cpu_share, "_samples", {})
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(cpus=cores)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        for p in busy:
            assert p.stdout is not None and p.stdout.readline() == "spinning\n"  # pinned and running
        os.sched_setaffinity(0, cores)
        try:
            assert cpu_share.usable_cores() == 2
            assert GPipe(_tiny(), balance=[2], chunks=2).threads_per_stage == 1
        finally:
            os.sched_setaffinity(0, mask)
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=30)

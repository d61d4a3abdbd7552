"""Process groups are made once per world: a process that builds pipeline after pipeline keeps its
thread and socket counts, and pipelines alive side by side (stepped in turn) share the groups."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab.pipeline.distributed import DistributedGPipe, topology
from gpipe_lab.pipeline.distributed.spawn import run_local


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def many_pipes_worker(rank: int, world: int) -> dict:
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(6, 4)
    counts = []
    for i in range(25):
        pipe = DistributedGPipe(_model(i), balance=[2, 1], chunks=3, timeout=60)
        pipe.train_step(x, y, F.mse_loss)
        del pipe
        if i in (1, 24):
            counts.append(_counts())
    a_model, b_model = _model(100), _model(200)
    want = [F.mse_loss(m(x), y).item() for m in (a_model, b_model)]
    a = DistributedGPipe(copy.deepcopy(a_model), balance=[2, 1], chunks=3, timeout=60)
    b = DistributedGPipe(copy.deepcopy(b_model), balance=[2, 1], chunks=2, timeout=60)
    losses = [float(p.train_step(x, y, F.mse_loss)) for p in (a, b, a, b)]  # no optimizer: the same loss
    return {"counts": counts, "want": want, "losses": losses}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads and sockets through /proc")
def test_building_pipeline_after_pipeline_keeps_threads_and_sockets_and_live_pipes_share_groups() -> None:
    for r in run_local(many_pipes_worker, 2, timeout=240):
        (threads_1, fds_1), (threads_24, fds_24) = r.value["counts"]
        assert threads_24 <= threads_1 + 2 and fds_24 <= fds_1 + 2, r.value["counts"]  # was +12 threads a pipe
        a, b = r.value["want"]
        assert r.value["losses"] == pytest.approx([a, b, a, b], rel=1e-5, abs=1e-6)


def test_a_group_is_made_once_per_role_and_world_and_a_new_world_makes_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple] = []
    fake = SimpleNamespace(group=SimpleNamespace(WORLD=object()),
                           new_group=lambda ranks, backend=None: made.append((tuple(ranks), backend)) or object())
    monkeypatch.setattr(topology, "dist", fake)
    monkeypatch.setattr(topology, "_made", {})
    monkeypatch.setattr(topology, "_made_in", [])
    first = topology._group(("act", 0, 1), [0, 1])
    assert topology._group(("act", 0, 1), [0, 1]) is first
    assert topology._group(("act", 0, 1), [0, 1], "gloo") is not first
    assert topology._group(("grad", 1, 0), [0, 1]) is not first  # each direction its own link
    assert made == [((0, 1), None), ((0, 1), "gloo"), ((0, 1), None)]
    fake.group.WORLD = object()  # destroy_process_group(), then init_process_group()
    assert topology._group(("act", 0, 1), [0, 1]) is not first and len(made) == 4

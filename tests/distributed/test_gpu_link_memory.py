"""GPU-shaped plumbing of the distributed transport, checked under gloo (K=2 x D=2, one launch).

On every rank, over three steps: each incoming link's receive stream is made once (a counting
stream factory); every link is warmed with a real send/receive pair, in the global order, before
the first step's traffic; a sent activation's storage is freed once its send completes, inside
the step (checkpointed micro-batches keep nothing else alive); the data-parallel all-reduce is
launched during the last backward, not after it; ``gather_timeline(on_device=True)`` takes a GPU
rank's device events (a stand-in here) and a CPU rank's host events; global-norm clipping equals
``torch.nn.utils.clip_grad_norm_`` on the unpipelined model (1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline.distributed.spawn import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]
M, MAX_NORM = 4, 0.05


def worker(rank: int, world: int) -> dict:
    from torch.multiprocessing.reductions import StorageWeakRef

    from gpipe_lab.pipeline.distributed import DistributedGPipe
    from gpipe_lab.pipeline.measuring.step_timeline import Event
    from gpipe_lab.pipeline.stage.runtime import StageRuntime

    log: list[tuple] = []
    held: dict[str, object] = {}
    sent: list[StorageWeakRef] = []
    real = {name: getattr(dist, name) for name in ("send", "recv", "isend", "all_reduce")}

    def send(tensor, dst, group=None, **kw):  # noqa: ANN001, ANN202 - torch.distributed's signature
        log.append(("warm", rank, dst))
        return real["send"](tensor, dst=dst, group=group, **kw)

    def recv(tensor, src, group=None, **kw):  # noqa: ANN001, ANN202
        log.append(("warm", src, rank))
        return real["recv"](tensor, src=src, group=group, **kw)

    def isend(tensor, dst, group=None, tag=0):  # noqa: ANN001, ANN202
        log.append(("isend", dst))
        if tensor.is_floating_point():
            sent.append(StorageWeakRef(tensor.untyped_storage()))
        return real["isend"](tensor, dst=dst, group=group, tag=tag)

    def all_reduce(tensor, group=None, async_op=False, **kw):  # noqa: ANN001, ANN202
        if group is not None and group is held.get("dp"):
            log.append(("all_reduce",))
        return real["all_reduce"](tensor, group=group, async_op=async_op, **kw)

    dist.send, dist.recv, dist.isend, dist.all_reduce = send, recv, isend, all_reduce
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    pipe = DistributedGPipe(model, balance=[2, 1], chunks=M, checkpoint="always", schedule="gpipe",
                            seed=0, bucket_bytes=1, timeout=60.0)
    held["dp"] = pipe.dp_group
    made: list[tuple] = []
    pipe.channel.link_streams.factory = lambda device: made.append((device,)) or object()
    real_backward = StageRuntime.backward
    freed_inside: list[bool] = []

    def backward(self, mb, grads):  # noqa: ANN001, ANN202
        log.append(("B", mb))
        out = real_backward(self, mb, grads)
        log.append(("B-end", mb))
        if self.index == 0 and sum(e[0] == "B" for e in log[step_start:]) == M:  # the step's last B
            idle = pipe.channel.sends.idle(30.0)
            freed_inside.append(idle and all(w.expired() for w in sent))
        return out

    StageRuntime.backward = backward
    torch.manual_seed(1)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    mine = slice(8 * pipe.dp_rank, 8 * pipe.dp_rank + 8)
    for _ in range(3):
        pipe.zero_grad()
        sent.clear()
        step_start = len(log)
        pipe.train_step(x[mine], y[mine], F.mse_loss)
    host = pipe.gather_timeline()
    if pipe.stage_index == 1:  # as a GPU rank: its actions come from device events, no host waits
        t0 = pipe.timeline.start
        pipe.timeline.device_source = lambda: [Event(1, "F", 0, t0 + 100.0, t0 + 101.0)]
    device = pipe.gather_timeline(on_device=True)
    timelines = {"host_kinds": sorted({(e.stage, e.kind) for e in host.events}),
                 "device_stage1": [(e.kind, e.microbatch, round(e.end - e.start, 6))
                                   for e in device.events if e.stage == 1],
                 "stage0_same": [e for e in device.events if e.stage == 0] == [e for e in host.events
                                                                               if e.stage == 0]}
    norm = pipe.clip_grad_norm_(MAX_NORM)
    F.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    grads_match = all(torch.allclose(p.grad, ref[first + int(name.split(".")[0])]
                                     .get_parameter(name.split(".", 1)[1]).grad, rtol=1e-5, atol=1e-5)
                      for first, part in pipe._chunks.values() for name, p in part.named_parameters())
    last = log[step_start:]
    b_begin = max(i for i, e in enumerate(last) if e[0] == "B")
    b_end = max(i for i, e in enumerate(last) if e[0] == "B-end")
    reduces = [i for i, e in enumerate(last) if e[0] == "all_reduce"]
    return {"made": len(made), "links_in": sum(1 for k in pipe.topo.links if k[2] == rank),
            "warmed": list(pipe.topo.warmed), "links": sorted(pipe.topo.links),
            "first_traffic": [e for e in log if e[0] in ("warm", "isend")][:len(pipe.topo.links) + 1],
            "freed_inside": freed_inside, "released": pipe.channel.sends.released,
            "reduces": reduces, "b_begin": b_begin, "b_end": b_end,
            "in_backward": pipe.grad_sync.launched_in_backward,
            "timelines": timelines, "norm": float(norm), "ref_norm": float(ref_norm), "grads_match": grads_match}


def test_links_streams_sends_all_reduce_and_clipping_under_gloo() -> None:
    results = run_local(worker, world_size=4, timeout=150)
    for r in results:
        assert r.error is None and r.exitcode == 0, r.error
        v = r.value
        assert v["made"] == v["links_in"] == 1, "one receive stream per incoming link, over three steps"
        assert v["warmed"] == v["links"] == sorted(v["links"])
        warm = [("warm", src, dst) for _, src, dst in v["links"]]
        assert v["first_traffic"][:-1] == warm and v["first_traffic"][-1][0] == "isend", v["first_traffic"]
        if r.rank % 2 == 0:  # stage 0 sends activations: freed before its last backward ends
            assert v["freed_inside"] == [True] * 3 and v["released"] > 0
        assert v["reduces"] and v["b_begin"] < v["reduces"][0] < v["b_end"], v
        assert v["in_backward"] == 3 * 2, "each stage's two buckets (weight, bias) launched by hooks, every step"
        assert abs(v["norm"] - v["ref_norm"]) <= 1e-5 * v["ref_norm"] and v["ref_norm"] > MAX_NORM
        assert v["grads_match"]
        timelines = v["timelines"]  # on_device(): the GPU rank's device events, the CPU rank's host ones
        assert (0, "wait") in timelines["host_kinds"] and (1, "wait") in timelines["host_kinds"]
        assert timelines["device_stage1"] == [("F", 0, 1.0)] and timelines["stage0_same"]

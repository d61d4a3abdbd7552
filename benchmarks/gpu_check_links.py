"""GPU check section on the distributed transport's links and memory, and clipping.

``distributed_links`` runs, in order:

- clipping: ``GPipe.clip_grad_norm_`` (K=2 on the check's device) against
  ``torch.nn.utils.clip_grad_norm_`` on the unpipelined model;
- with two GPUs (NCCL; two ranks on one GPU are refused by design) or in a dry
  run (gloo, CPU): a K=2 ``DistributedGPipe`` over 5 steps reporting, per rank,
  its gradients against the unpipelined model's (fp32, 1e-5, this rank's layers),
  receive streams made (one per incoming link, however many steps), the links
  warmed before the first step's traffic and in which order, whether every send
  was released by the last backward of the step, the sent tensors still alive
  then (0 under gloo: freed on send completion; NCCL's watchdog may hold a
  finished one until its next pass),
  and ``torch.cuda.memory_reserved`` after each step (flat after the first two).

With one GPU the distributed part is SKIPped and says why; clipping still runs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.gpu_check_engine import Context, relative_grad_error
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.distributed.spawn import run_local

STEPS, M = 5, 4
#: seconds the two-rank links run may take before its ranks are killed (the section's cap is above it)
LAUNCH_TIMEOUT = 45.0


def clipping(ctx: Context) -> dict[str, Any]:
    """The pipelined global-norm clip against the unpipelined one (relative error of the norm and grads)."""
    torch.manual_seed(0)
    width = 16 if ctx.dry else 512
    module = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                           nn.Linear(width, 4)).to(ctx.device)
    ref = copy.deepcopy(module)
    x, y = torch.randn(32, width, device=ctx.device), torch.randn(32, 4, device=ctx.device)
    pipe = GPipe(module, partitions=2, chunks=4, devices=[ctx.device] * 2, checkpoint="never")
    pipe.train_step(x, y, F.mse_loss)
    norm = pipe.clip_grad_norm_(0.01)
    F.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    grad_error = max(float((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp(min=1e-12))
                     for a, b in zip(ref.parameters(), module.parameters()))
    return {"norm_relative_error": float((norm - ref_norm).abs() / ref_norm), "grad_relative_error": grad_error}


def link_worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    """One rank of the K=2 run (``run_local``): what its links and memory did."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from gpipe_lab.pipeline.distributed import DistributedGPipe
    from gpipe_lab.pipeline.stage.runtime import StageRuntime

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    traffic: list[tuple] = []
    sent: list[Any] = []
    real_send, real_recv, real_isend = dist.send, dist.recv, dist.isend

    def send(tensor: Any, dst: int, group: Any = None, **kw: Any) -> Any:
        traffic.append(("warm", rank, dst))
        return real_send(tensor, dst=dst, group=group, **kw)

    def recv(tensor: Any, src: int, group: Any = None, **kw: Any) -> Any:
        traffic.append(("warm", src, rank))
        return real_recv(tensor, src=src, group=group, **kw)

    def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> Any:
        traffic.append(("isend", dst))
        if tensor.is_floating_point():
            sent.append(StorageWeakRef(tensor.untyped_storage()))
        return real_isend(tensor, dst=dst, group=group, tag=tag)

    dist.send, dist.recv, dist.isend = send, recv, isend
    torch.backends.cuda.matmul.allow_tf32 = False  # the unpipelined reference in full float32
    torch.manual_seed(0)
    width = 16 if not cuda else 1024
    module = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    reference = copy.deepcopy(module).to(device)
    pipe = DistributedGPipe(module, partitions=2,
                            chunks=M, checkpoint="always", schedule="gpipe", device=device, seed=0)
    real_make = pipe.channel.link_streams.factory
    if real_make is None:  # the CPU makes no streams: count the requests instead
        pipe.channel.link_streams.factory = lambda d: object()
    alive_at_last_backward: list[int] = []
    released_at_last_backward: list[bool] = []
    real_backward = StageRuntime.backward
    calls = [0]

    def backward(self: StageRuntime, mb: int, grads: Any) -> Any:
        out = real_backward(self, mb, grads)
        calls[0] += 1
        if self.index == 0 and calls[0] % M == 0:
            released_at_last_backward.append(pipe.channel.sends.idle(30.0))
            alive_at_last_backward.append(sum(not w.expired() for w in sent))
        return out

    StageRuntime.backward = backward  # type: ignore[method-assign]
    x, y = torch.randn(64, width, device=device), torch.randn(64, width, device=device)
    reserved = []
    for _ in range(steps):
        sent.clear()
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, F.mse_loss)
        if cuda:
            torch.cuda.synchronize(device)
            reserved.append(torch.cuda.memory_reserved(device))
    # every step recomputes the same gradients (no optimizer step): the last one against one
    # unpipelined step, over this rank's layers
    F.mse_loss(reference(x), y).backward()
    start = sum(pipe.balance[:pipe.stage_index])
    grad_error = relative_grad_error(reference[start:start + pipe.balance[pipe.stage_index]], pipe.stage_module)
    links = sorted(pipe.topo.links)
    first = [e for e in traffic if e[0] in ("warm", "isend")][:len(links) + 1]
    return {"grad_relative_error_vs_unpipelined": grad_error,
            "receive_streams_made": pipe.channel.link_streams.made,
            "incoming_links": sum(1 for k in links if k[2] == rank),
            "warm_up_in_global_order": list(pipe.topo.warmed) == links,
            "warm_up_before_first_send": first[:-1] == [("warm", s, d) for _, s, d in links]
            and first[-1][0] == "isend",
            "sends_released_at_last_backward": released_at_last_backward if pipe.stage_index == 0 else None,
            "sent_alive_at_last_backward": alive_at_last_backward if pipe.stage_index == 0 else None,
            "reserved_bytes": reserved}


def distributed_links(ctx: Context) -> dict[str, Any]:
    """Clipping, then the K=2 links run (two GPUs with NCCL; gloo on the CPU in a dry run)."""
    clip = clipping(ctx)
    result: dict[str, Any] = {"clipping": clip}
    ok = clip["norm_relative_error"] <= 1e-5 and clip["grad_relative_error"] <= 1e-5
    if not ctx.dry and torch.cuda.device_count() < 2:
        result["links"] = "SKIP: needs two GPUs (NCCL refuses two ranks on one GPU)"
        return {"status": "PASS" if ok else "FAIL", **result}
    ranks = run_local(link_worker, world_size=2, args=(STEPS,), timeout=LAUNCH_TIMEOUT,
                      backend="gloo" if ctx.dry else "nccl")
    rows = []
    for r in ranks:
        if r.error is not None or not isinstance(r.value, dict):
            rows.append({"rank": r.rank, "error": (r.error or f"exit code {r.exitcode}")[-400:]})
            ok = False
            continue
        v = {"rank": r.rank, **r.value}
        reserved = v["reserved_bytes"]
        v["reserved_flat_after_two_steps"] = len(set(reserved[2:])) <= 1
        # NCCL's watchdog keeps a finished Work (and its tensor) until its next pass: on a GPU the
        # criterion is that the engine let go of every send; gloo frees the storage itself
        released = v["sends_released_at_last_backward"]
        freed = v["sent_alive_at_last_backward"] if ctx.dry else [0]
        ok = ok and v["grad_relative_error_vs_unpipelined"] <= 1e-5 \
            and v["receive_streams_made"] == v["incoming_links"] and v["warm_up_in_global_order"] \
            and v["warm_up_before_first_send"] and v["reserved_flat_after_two_steps"] \
            and (released is None or (all(released) and not any(freed)))
        rows.append(v)
    result["backend"] = "gloo (CPU, dry run)" if ctx.dry else "nccl"
    result["ranks"] = rows
    return {"status": "PASS" if ok else "FAIL", **result}

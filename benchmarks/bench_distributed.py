"""DistributedGPipe vs torch.distributed.pipelining on 2 gloo CPU processes.

8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), batch 1024, MSE, one
intra-op thread per process, no re-materialization on either side (the peer
has none). For M in {8, 16}: seconds per training step (median of --steps
after --warmup) of our transport (gpipe and 1f1b schedules) and of
ScheduleGPipe / Schedule1F1B, plus a sequential single-thread baseline.

    python benchmarks/bench_distributed.py --out results/bench_distributed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.launch import run_local

WIDTH, HIDDEN, BLOCKS, BATCH = 512, 2048, 8, 1024


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
                           for _ in range(BLOCKS)])


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def timed(step, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def ours(M: int, schedule: str, warmup: int, steps: int) -> tuple[list[float], float]:
    pipe = DistributedGPipe(model(), partitions=2, chunks=M, schedule=schedule, checkpoint="never", seed=0)
    x, y = data()

    def step() -> None:
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(x, y, F.mse_loss)

    times = timed(step, warmup, steps)
    return times, pipe.gather_timeline().measured_bubble()


def theirs(M: int, schedule: str, warmup: int, steps: int) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    layers = list(model().children())
    part = nn.Sequential(*layers[rank * BLOCKS // 2:(rank + 1) * BLOCKS // 2])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=M, loss_fn=F.mse_loss)
    x, y = data()

    def step() -> None:
        for p in part.parameters():
            p.grad = None
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])

    return timed(step, warmup, steps)


def worker(rank: int, world: int, ms: list[int], warmup: int, steps: int) -> dict:
    out = {}
    for M in ms:
        for schedule in ("gpipe", "1f1b"):
            times, bubble = ours(M, schedule, warmup, steps)
            out[f"ours/{schedule}/M={M}"] = {"median_s": statistics.median(times), "times": times,
                                             "measured_bubble": bubble}
            times = theirs(M, schedule, warmup, steps)
            out[f"torch/{schedule}/M={M}"] = {"median_s": statistics.median(times), "times": times}
    return out


def sequential(warmup: int, steps: int) -> float:
    torch.set_num_threads(1)
    net, (x, y) = model(), data()
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        net.zero_grad(set_to_none=True)
        F.mse_loss(net(x), y).backward()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = run_local(worker, 2, args=(args.microbatches, args.warmup, args.steps), timeout=1800)
    for r in results:
        if r.exitcode != 0:
            raise SystemExit(f"rank {r.rank} failed: {r.error}")
    rows = results[0].value
    report = {"sequential_1_thread_s": sequential(args.warmup, args.steps), "runs": rows, "ratios": {}}
    print(f"sequential (1 thread): {report['sequential_1_thread_s']:.3f} s/step")
    for M in args.microbatches:
        for schedule in ("gpipe", "1f1b"):
            mine, peer = rows[f"ours/{schedule}/M={M}"], rows[f"torch/{schedule}/M={M}"]
            ratio = peer["median_s"] / mine["median_s"]
            report["ratios"][f"{schedule}/M={M}"] = ratio
            print(f"M={M:2d} {schedule:5s}: ours {mine['median_s']:.3f} s (bubble {mine['measured_bubble']:.2f}) "
                  f"torch.distributed.pipelining {peer['median_s']:.3f} s -> ours is {ratio:.2f}x as fast; "
                  f"speed-up over sequential {report['sequential_1_thread_s'] / mine['median_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

"""The distributed transport (one process per stage, gloo on CPU) under faults, over time,
and against the local transport.

test_distributed_failures.py (the distributed engineer's) covers a rank that raises in
forward, a SIGKILLed rank and a hung rank. Added here: faults in BACKWARD and in the
RECOMPUTE of a checkpointed micro-batch, on first and last stages, under both schedules;
the determinism rule across transports; a 200-step soak with flat memory.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local

pytestmark = [pytest.mark.distributed]
TIMEOUT = 6.0


# ----------------------------------------------------------------------------- faults
def fault_worker(rank: int, world: int, when: str, stage: int, schedule: str) -> None:
    from helpers.faults import SEED, Fault

    fault = Fault(when, stage, microbatch=2)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(world):
        layers += [nn.Linear(6, 6), nn.Tanh(), fault if k == stage else nn.Identity()]
    pipe = DistributedGPipe(nn.Sequential(*layers), balance=[3] * world, chunks=4, seed=SEED, schedule=schedule,
                            checkpoint="always" if when == "recompute" else "never", timeout=TIMEOUT)
    g = torch.Generator().manual_seed(3)
    pipe.train_step(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), F.mse_loss)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when,stage,schedule", [
    ("backward", 0, "gpipe"),
    ("backward", 1, "1f1b"),
    ("recompute", 0, "1f1b"),
    pytest.param("recompute", 1, "gpipe", marks=pytest.mark.slow),
    pytest.param("forward", 0, "1f1b", marks=pytest.mark.slow),
])
def test_fault_in_backward_or_recompute_stops_every_rank_naming_it(when, stage, schedule):
    results = run_local(fault_worker, 2, args=(when, stage, schedule), timeout=60)
    culprit, other = results[stage], results[1 - stage]
    assert all(r.ended is not None for r in results), "a rank was still alive at the deadline"
    assert culprit.exitcode == 1 and culprit.error_type == "InjectedFault", culprit.error
    phase = "forward" if when == "forward" else "backward"
    assert f"injected fault in {when}" in culprit.error
    assert f"{phase} of micro-batch 2" in culprit.error and f"stage {stage}" in culprit.error, culprit.error
    assert other.exitcode == 1, other.error
    assert f"rank {stage}" in other.error, other.error
    # the peer learns of the failure through the abort channel, not by waiting out the timeout
    assert other.ended < culprit.ended + TIMEOUT, (other.ended, culprit.ended)


# ----------------------------------------------------------------------------- determinism
def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.2),
                         nn.GELU(), nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 4))


def plain_model() -> nn.Sequential:
    model = dropout_model()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def batches(steps: int):
    g = torch.Generator().manual_seed(42)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def train(pipe, params, steps: int) -> list[float]:
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    out = []
    for x, y in batches(steps):
        opt.zero_grad()
        out.append(pipe.train_step(x, y, F.mse_loss).item())
        opt.step()
    return out


def distributed_losses(world: int, build: str, chunks: int, checkpoint: str, steps: int) -> list[float]:
    model = {"dropout": dropout_model, "plain": plain_model}[build]()
    pipe = DistributedGPipe(model, balance=[3, 3, 3][:world] if world == 3 else [4, 5], chunks=chunks, seed=5,
                            checkpoint=checkpoint, timeout=60)
    return train(pipe, pipe.parameters(), steps)


def losses_worker(rank: int, world: int, steps: int) -> dict[str, list[float]]:
    """Both runs in one launch (a launch costs seconds of imports)."""
    return {"dropout": distributed_losses(world, "dropout", 4, "never", steps),
            "plain": distributed_losses(world, "plain", 8, "always", steps)}


def local_losses(build, balance, chunks: int, checkpoint: str, steps: int) -> list[float]:
    from gpipe_lab import GPipe

    model = build()
    return train(GPipe(model, balance=balance, chunks=chunks, seed=5, checkpoint=checkpoint), model.parameters(),
                 steps)


@pytest.mark.timeout(180)
def test_transport_does_not_change_the_losses():
    """Same seed, K and M: dropout masks are the same in threads and in processes (bitwise);
    without dropout, another M / checkpoint mode / transport agrees to 1e-5."""
    steps = 8
    results = run_local(losses_worker, 2, args=(steps,), timeout=150)
    for r in results:
        assert r.exitcode == 0, r.error
    dist_dropout, dist_plain = [r.value["dropout"] for r in results], [r.value["plain"] for r in results]
    assert dist_dropout[0] == dist_dropout[1]  # every rank returns the shared loss
    assert dist_dropout[0] == local_losses(dropout_model, [4, 5], 4, "always", steps)
    assert dist_plain[0] == pytest.approx(local_losses(plain_model, [9], 2, "except_last", steps),
                                          rel=1e-5, abs=1e-6)


# ----------------------------------------------------------------------------- soak
# Fewer micro-batches than the local soak: a step's cost here is mostly per message, while the
# batch (hence what a step saves, and what a leak would add per step) stays the same; a leaked
# micro-batch is 4x larger, so leaks stay far above ALLOWED_GROWTH over the post-warm-up steps.
SOAK_CHUNKS = 2


def soak_worker(rank: int, world: int, steps: int, warmup: int, chunks: int) -> list[int]:
    import gc

    from helpers.soak import BATCH, rss_bytes, soak_model

    model = soak_model()
    pipe = DistributedGPipe(model, partitions=world, chunks=chunks, seed=0, checkpoint="except_last",
                            timeout=60)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    samples = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, F.cross_entropy)
        assert torch.isfinite(loss)
        opt.step()
        if step >= warmup and step % 10 == 0:
            gc.collect()
            samples.append(rss_bytes())
    assert all(not r._saved and r.live_bytes == 0 for r in pipe.runtimes.values())
    return samples


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_distributed_transport_200_steps_no_memory_growth():
    from helpers.soak import ALLOWED_GROWTH, STEPS, WARMUP, K

    results = run_local(soak_worker, K, args=(STEPS, WARMUP, SOAK_CHUNKS), timeout=200)
    for r in results:
        assert r.exitcode == 0, r.error
        samples = r.value
        growth = max(samples[len(samples) // 2:]) - samples[0]
        assert growth < ALLOWED_GROWTH, f"rank {r.rank}: RSS grew {growth / 2**20:.1f} MiB after warm-up"

"""Long skips on DistributedGPipe over gloo: the U-Net against the unpipelined Sequential, to 1e-5.

One bounded launch of 2 ranks runs every case (a launch costs seconds of imports): the K = 2
cut (each feature on a skip link of its own between the two ranks) under fill-drain, 1F1B and
zero-bubble, and the interleaved form with 4 chunks on 2 ranks ([3, 1, 3, 2]), where skips join chunks of one
rank (handed over in the process) and of both. Each case returns the per-step losses and this
rank's gradients under the unpipelined module's names.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gpipe_lab.bench.unet import unet
from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240), pytest.mark.xdist_group("test_skip_distributed")]

# (schedule, virtual stages, balance, checkpoint)
CASES = [("gpipe", 1, [4, 5], "always"), ("1f1b", 1, [3, 6], "except_last"), ("zb-h1", 1, [5, 4], "never"),
         ("interleaved-1f1b", 2, [3, 1, 3, 2], "always"),
         ("zb-v", 2, [3, 1, 3, 2], "except_last")]  # V placement: a skip from stage 0 to 3 stays on rank 0
STEPS, CHUNKS = 2, 3


def batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)


def case(schedule: str, v: int, balance: list[int], checkpoint: str) -> tuple[list[float], dict[str, Tensor]]:
    pipe = DistributedGPipe(unet(), balance=balance, chunks=CHUNKS, schedule=schedule, virtual_stages=v,
                            checkpoint=checkpoint)
    params = [p for _, part in pipe._chunks.values() for p in part.parameters()]
    sgd = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step in range(STEPS):
        sgd.zero_grad()
        losses.append(pipe.train_step(*batch(step), F.mse_loss).item())
        if step < STEPS - 1:
            sgd.step()
    grads = {f"{int(i) + first}.{rest}": p.grad.clone()
             for first, part in pipe._chunks.values() for name, p in part.named_parameters()
             for i, _, rest in [name.partition(".")]}
    return losses, grads


def worker(rank: int, world: int) -> list[Any]:
    results: list[Any] = []
    for c in CASES:
        try:
            results.append(case(*c))
        except Exception as exc:  # noqa: BLE001 - reported by the case's test
            results.append(f"raised {type(exc).__name__}: {exc}")
    return results


@pytest.fixture(scope="module")
def results() -> list[list[Any]]:
    ranks = run_local(worker, 2, timeout=200)
    for r in ranks:
        assert r.exitcode == 0, r.error
    return [r.value for r in ranks]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_unet_with_skips_on_two_ranks_equals_unpipelined(results: list, index: int) -> None:
    model = unet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for step in range(STEPS):
        sgd.zero_grad()
        loss = F.mse_loss(model(batch(step)[0]), batch(step)[1])
        loss.backward()
        want.append(loss.item())
        if step < STEPS - 1:
            sgd.step()
    grads: dict[str, Tensor] = {}
    for rank in results:
        got = rank[index]
        assert not isinstance(got, str), got
        assert got[0] == pytest.approx(want, abs=1e-5)
        grads.update(got[1])
    expected = dict(model.named_parameters())
    assert sorted(grads) == sorted(expected)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name].grad, atol=1e-5, rtol=1e-5, msg=name)

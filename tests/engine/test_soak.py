"""Soak: 200 steps at K=2, M=8 under each transport; memory must not grow after warm-up.

The default app config (AmoebaNet-D tiny on synthetic images) is far too slow on
two shared CPU cores for 200 steps inside a test, so these drive the engine
directly with an MLP whose per-step activations are large: a leak of one step's
saved activations, recompute inputs or timeline events would add megabytes per
step and shows up in the resident set size (RSS) long before step 200.

Two things keep the 200 steps to seconds on two cores: the caller runs single-threaded
(each stage already runs one intra-op thread on its own core; the caller's optimizer
step on a second intra-op thread contends with them, 3-4x slower per step here), and
the objects alive before the soak are frozen out of the garbage collector, so each
``gc.collect()`` before an RSS sample walks only what the soak made, not the whole
test process.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from torch.nn import functional as F

from gpipe_lab import GPipe
from helpers.soak import ALLOWED_GROWTH, BATCH, STEPS, WARMUP, K, M, rss_bytes, soak_model


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_local_transport_200_steps_no_memory_growth():
    threads = torch.get_num_threads()
    gc.collect()
    gc.freeze()
    torch.set_num_threads(1)
    try:
        _soak()
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()


def _soak() -> None:
    model = soak_model()
    pipe = GPipe(model, partitions=K, chunks=M, checkpoint="except_last", seed=0, timeout=60)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    samples, events = [], []
    start = time.monotonic()
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, F.cross_entropy)
        opt.step()
        assert torch.isfinite(loss)
        events.append(len(pipe.timeline.events))
        if step == 0:
            pipe.forward(x[:16])  # evaluation interleaved with training must not leak either
        if step >= WARMUP and step % 10 == 0:
            gc.collect()
            samples.append(rss_bytes())
    elapsed = time.monotonic() - start
    assert all(not s._saved and s.live_bytes == 0 for s in pipe.stages)
    assert len(set(events[1:])) == 1, "timeline events per step must not grow"
    growth = max(samples[len(samples) // 2:]) - samples[0]
    assert growth < ALLOWED_GROWTH, f"RSS grew {growth / 2**20:.1f} MiB over {STEPS - WARMUP} steps ({elapsed:.0f} s)"

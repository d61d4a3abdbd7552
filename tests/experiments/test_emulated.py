"""Emulated devices (``gpipe_lab.bench.emulated``): structure of an emulated step, not its duration.

An emulated step must run the schedule's actions, give the unpipelined gradients,
and spend its busy time asleep (off the CPU), on both transports.
"""

from __future__ import annotations

import time

import pytest
import torch

from gpipe_lab.bench import EmulatedSpec, emulated_workload
from gpipe_lab.bench.emulated import EmulatedLayer, balanced
from gpipe_lab.pipeline import GPipe, Timeline
from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local
from gpipe_lab.planner.workload import WorkloadSpec

#: 4 layers of 2.5 ms per sample on 8 samples: 10 ms forward per layer and mini-batch.
LAYER_S, BATCH = 2.5e-3 / 8, 8


def kinds(timeline: Timeline) -> list[tuple[int, str]]:
    return sorted((e.stage, e.kind) for e in timeline.events if e.kind != "wait")


def expected_kinds(stages: int, chunks: int) -> list[tuple[int, str]]:
    """GPipe with ``except_last``: every micro-batch F and B, all but the last replayed (R)."""
    return sorted([(k, kind) for k in range(stages) for kind in "FB" for _ in range(chunks)]
                  + [(k, "R") for k in range(stages) for _ in range(chunks - 1)])


def test_emulated_step_runs_the_schedule_off_the_cpu_with_exact_gradients() -> None:
    work = emulated_workload("emu", [LAYER_S * 8] * 4, BATCH, balanced(4, 2))
    reference = emulated_workload("emu", [0.0] * 4, BATCH, [4])
    pipe = GPipe(work.module, balance=work.balance, chunks=4, threads_per_stage=1, seed=0)
    cpu = time.process_time()
    loss = pipe.train_step(work.inputs, work.targets, work.loss_fn)
    cpu = time.process_time() - cpu
    assert pipe.timeline is not None
    assert kinds(pipe.timeline) == expected_kinds(2, 4)
    busy = sum(pipe.timeline.busy())
    assert cpu < 0.5 * busy, f"{cpu:.3f} s of CPU for {busy:.3f} s of emulated work"
    expected = reference.loss_fn(reference.module(reference.inputs), reference.targets)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    for mine, theirs in zip(work.module.parameters(), reference.module.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)


def distributed_worker(rank: int, world: int) -> tuple[list, float, float]:
    work = emulated_workload("emu", [LAYER_S * 8] * 4, BATCH, balanced(4, world))
    pipe = DistributedGPipe(work.module, balance=work.balance, chunks=2, seed=0)
    cpu = time.process_time()
    pipe.train_step(work.inputs, work.targets, work.loss_fn)
    cpu = time.process_time() - cpu
    assert pipe.timeline is not None
    return kinds(pipe.timeline), cpu, pipe.timeline.busy()[rank]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_emulated_layers_run_on_the_distributed_transport() -> None:
    results = run_local(distributed_worker, 2, timeout=200)
    for r in results:
        assert r.exitcode == 0, r.error
        timeline_kinds, _, busy = r.value  # each rank's timeline holds its own stage
        assert timeline_kinds == [x for x in expected_kinds(2, 2) if x[0] == r.rank]
        assert busy > 0


def test_emulated_spec_scales_the_flops_cost_model() -> None:
    spec = WorkloadSpec("t", "transformer_tiny", {"num_layers": 2, "d_model": 16, "ffn_dim": 32, "num_heads": 2,
                                                   "vocab_size": 32, "seq_len": 4}, 8)
    emulated = EmulatedSpec(spec, forward_ms=40.0)
    seconds = emulated.per_sample_seconds()
    flops = spec.flops()
    assert sum(seconds) * spec.batch == pytest.approx(0.040)
    assert seconds == pytest.approx([0.040 / spec.batch * f / sum(flops) for f in flops])
    model = spec.model()
    assert emulated.build(2).balance == spec.balance(model, 2)
    assert EmulatedSpec(spec, 40.0, uniform=True).build(2).balance == balanced(len(model), 2)


@pytest.mark.parametrize("kwargs", [{"per_sample_s": -1.0}, {"per_sample_s": 1.0, "fixed_s": -1.0}])
def test_negative_emulated_times_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        EmulatedLayer(**kwargs)


def test_layer_sleeps_fixed_plus_per_sample() -> None:
    layer = EmulatedLayer(per_sample_s=1e-3, fixed_s=2e-3)
    assert layer.forward_seconds(8) == pytest.approx(1e-2)


def test_a_split_backward_sleeps_the_weight_share_only_in_the_weight_gradient(monkeypatch) -> None:
    """With ``weight_share`` the input gradient (a zero-bubble B) sleeps 1-s of the backward and
    the weight gradient (W) the rest; the gradients are the plain layer's."""
    from gpipe_lab.bench import emulated

    slept: list[float] = []
    monkeypatch.setattr(emulated.time, "sleep", slept.append)
    split, plain = EmulatedLayer(1e-3, weight_share=0.25), EmulatedLayer(1e-3)
    x = torch.full((4, 1), 2.0, requires_grad=True)
    out = split(x)
    assert slept == [pytest.approx(4e-3), 0.0]  # the forward: the layer's time once
    slept.clear()
    (dx,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)  # B: the input's side only
    assert slept == [pytest.approx(8e-3 * 0.75)]
    slept.clear()
    (dw,) = torch.autograd.grad(out.sum(), [split.weight])  # W: the weight's side only
    assert slept == [pytest.approx(8e-3 * 0.25)]
    ref = torch.autograd.grad(plain(x).sum(), [x, plain.weight])
    torch.testing.assert_close((dx, dw), ref)
    with pytest.raises(ValueError, match=r"weight_share must be in \[0, 1\], got 1.5"):
        EmulatedLayer(1e-3, weight_share=1.5)

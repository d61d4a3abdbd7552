"""Zero-bubble schedules: exact loss and gradients, complete valid lists, cheap W, errors with state."""

from __future__ import annotations

import gc
import threading
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline import PipelineTimeoutError
from gpipe_lab.pipeline.stage.weight_gradients import input_backward, plan_split, split_weight_backward
from helpers.models import grads, mlp, reference_step, tuple_model
from helpers.threads import wait_for_stage_threads

TOL = 1e-5


def assert_close(a, b):
    assert torch.allclose(a, b, atol=TOL, rtol=TOL), (a - b).abs().max().item()


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "gpipe-bw"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("K,M", [(2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 8)])
@pytest.mark.parametrize("build", [mlp, tuple_model], ids=["tensor", "tuple"])
def test_loss_and_grads_equal_unpipelined(build, K, M, checkpoint, schedule):
    torch.manual_seed(1)
    x, y = torch.randn(2 * M + 1, 8), torch.randn(2 * M + 1, 8)
    ref_loss, ref_grads = reference_step(build(), x, y, F.mse_loss)
    model = build()
    pipe = GPipe(model, partitions=K, chunks=M, checkpoint=checkpoint, schedule=schedule)
    assert_close(pipe.train_step(x, y, F.mse_loss), ref_loss)
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)
    counts = Counter((e.stage, e.kind, e.microbatch) for e in pipe.timeline.events if e.kind in "FBW")
    assert set(counts.values()) == {1} and len(counts) == 3 * K * M
    replays = sum(e.kind == "R" for e in pipe.timeline.events)
    assert replays == (K * M if checkpoint == "always" else 0)  # recompute once, before B


def test_weight_pass_does_not_repeat_the_input_pass():
    """W computes only weight gradients: far fewer autograd nodes run than in a full backward."""
    torch.manual_seed(0)
    model = mlp(depth=4, width=16)
    params = list(model.parameters())
    x = torch.randn(5, 16, requires_grad=True)
    g = torch.randn(5, 16)
    out = model(x)
    plan = plan_split([out], [x], params)
    assert plan is not None and len(plan.tasks) == 8  # one per nn.Linear
    (gx,) = input_backward(plan, [out], [g], [x])
    assert all(p.grad is None for p in params)  # B touched no weight
    split_weight_backward(plan)
    want_x, *want = torch.autograd.grad(model(x), [x, *params], g)
    assert_close(gx, want_x)
    for p, w in zip(params, want):
        assert_close(p.grad, w)


class Twice(nn.Module):
    """One Linear applied twice: its weight is reached from both sides of the second call."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_tied_weights_fall_back_to_the_exact_generic_path():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), Twice(6), nn.Linear(6, 6))
    model = build()
    x = torch.randn(4, 6, requires_grad=True)
    assert plan_split([model(x)], [x], list(model.parameters())) is None
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    ref_loss, ref_grads = reference_step(build(), x, y, F.mse_loss)
    model = build()
    pipe = GPipe(model, balance=[1, 3], chunks=4, schedule="zb-h1", checkpoint="never")
    assert_close(pipe.train_step(x, y, F.mse_loss), ref_loss)
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)


def test_conv_layers_split_exactly():
    torch.manual_seed(0)
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                             nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x, y = torch.randn(8, 3, 6, 6), torch.randn(8, 5)
    ref_loss, ref_grads = reference_step(build(), x, y, F.mse_loss)
    model = build()
    pipe = GPipe(model, balance=[1, 2, 2], chunks=4, schedule="zb-h1", checkpoint="except_last")
    assert_close(pipe.train_step(x, y, F.mse_loss), ref_loss)
    for got, want in zip(grads(model), ref_grads):
        assert_close(got, want)


class Stall(nn.Module):
    """Stalls on micro-batch ``at`` until the other stage has timed out waiting for it."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls, self.armed = at, 0, True

    def forward(self, x):
        self.calls += 1
        if self.armed and self.calls == self.at + 1:
            wait_for_stage_threads()
        return x


@pytest.mark.timeout(30)
def test_timeout_error_carries_the_zb_h1_schedule_state():
    stall = Stall(at=2)
    stall.armed = False
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), stall, nn.Linear(8, 8))
    pipe = GPipe(model, balance=[2, 2], chunks=4, schedule="zb-h1", checkpoint="never", timeout=1.0)
    # a first step without the stall: the random-replay probe serializes the first step's forwards
    pipe.train_step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss)
    stall.armed, stall.calls = True, 0
    before = threading.active_count()
    with pytest.raises(PipelineTimeoutError, match="schedule state") as info:
        pipe.train_step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss)
    message = str(info.value)
    assert "stage 0: last completed" in message and "stage 1:" in message
    assert any(a is not None and a.kind in "FBW" for a in info.value.done)
    assert threading.active_count() == before
    stall.armed = False
    pipe.timeout = 60.0  # the machine may be busy: only the failure above needs a short timeout
    model.zero_grad()
    assert torch.isfinite(pipe.train_step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss))


class Probe(nn.Module):
    """Passes its input on through a new tensor and keeps only a weak reference to it.

    The next nn.Linear saves that tensor for its weight gradient, so it lives exactly as
    long as the graph a split W keeps (``retain_graph``) lives.
    """

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 1.0
        self.outputs.append(weakref.ref(out))
        return out


def _alive(probes: list[Probe]) -> int:
    alive = sum(ref() is not None for probe in probes for ref in probe.outputs)
    if alive:
        gc.collect()  # only a graph that even Python's GC cannot reclaim counts as a leak
        alive = sum(ref() is not None for probe in probes for ref in probe.outputs)
    for probe in probes:
        probe.outputs.clear()
    return alive


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "gpipe-bw", "1f1b"])
@pytest.mark.parametrize("track_memory", [True, False])
def test_split_graphs_are_freed_after_each_step(schedule, track_memory):
    """A graph kept for W (retain_graph) is freed when its W is done: no activation outlives its step.

    With memory tracking, the graph holds the pack hook whose closure held the stage's
    per-micro-batch record, which held the graph: a cycle Python's GC cannot see (it goes
    through C++), so every step's activations leaked (~25 MB/step on the benchmark MLP).
    A probe in each stage follows one saved activation per micro-batch by weak reference
    (walking every live object instead takes seconds per step in a big test process).
    """
    blocks = mlp()
    probes = [Probe(), Probe()]
    model = nn.Sequential(*blocks[:2], probes[0], blocks[2], *blocks[3:5], probes[1], blocks[5])
    pipe = GPipe(model, balance=[4, 4], chunks=4, schedule=schedule, checkpoint="never",
                 track_memory=track_memory)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for step in range(3):
        pipe.train_step(x, y, F.mse_loss)
        model.zero_grad(set_to_none=True)
        assert _alive(probes) == 0, f"step {step}: a micro-batch's graph outlived the step"


def _split_steps(model: nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
    """B for every micro-batch, then every W (gradients accumulate as in a step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    plans = []
    for x, g in zip(xs, gs):
        x = x.detach().requires_grad_()
        out = model(x)
        plan = plan_split([out], [x], params)
        assert plan is not None
        input_backward(plan, [out], [g], [x])
        plans.append(plan)
    for plan in plans:
        split_weight_backward(plan)


def test_linear_weight_pass_is_direct_and_exact():
    """nn.Linear (with and without bias) takes the direct W (no engine call), accumulating exactly."""
    from gpipe_lab.pipeline.stage.linear_weights import linear_weight_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16, bias=False))
    xs, gs = [torch.randn(5, 16) for _ in range(3)], [torch.randn(5, 16) for _ in range(3)]
    x = torch.randn(5, 16, requires_grad=True)
    out = model(x)
    plan = plan_split([out], [x], list(model.parameters()))
    input_backward(plan, [out], [gs[0]], [x])
    direct = [linear_weight_grads([t.edges[0].node], [t.grads[0]], t.params) for t in plan.tasks]
    assert direct == [True, True]
    model.zero_grad(set_to_none=True)
    _split_steps(model, xs, gs)
    got = [p.grad.clone() for p in model.parameters()]
    want = [sum(ws) for ws in zip(*(torch.autograd.grad(model(x), list(model.parameters()), g)
                                    for x, g in zip(xs, gs)))]
    for a, b in zip(got, want):
        assert_close(a, b)


def test_parameter_hooks_keep_the_autograd_weight_pass():
    """A gradient hook on a weight must fire: that layer's W goes through autograd."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    fired = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    xs, gs = [torch.randn(5, 16) for _ in range(2)], [torch.randn(5, 16) for _ in range(2)]
    _split_steps(model, xs, gs)
    assert len(fired) == 2  # once per micro-batch, as in a plain backward
    want = sum(torch.autograd.grad(model(x), [model[0].weight], g)[0] for x, g in zip(xs, gs))
    assert_close(model[0].weight.grad, want)


def test_batched_weight_pass_equals_per_microbatch_autograd():
    """All micro-batches' W at once: one GEMM per Linear, per micro-batch for the rest (a conv)."""
    from gpipe_lab.pipeline.stage.weight_gradients import batched_weight_backward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (1, 16)), nn.Conv1d(1, 2, 3, padding=1), nn.Flatten(),
                          nn.Linear(32, 24), nn.GELU(), nn.Linear(24, 16, bias=False))
    params = list(model.parameters())
    xs, gs = [torch.randn(5, 16) for _ in range(3)], [torch.randn(5, 16) for _ in range(3)]
    plans = []
    for x, g in zip(xs, gs):
        x = x.detach().requires_grad_()
        out = model(x)
        plan = plan_split([out], [x], params)
        input_backward(plan, [out], [g], [x])
        plans.append(plan)
    batched_weight_backward(plans)
    want = [sum(ws) for ws in zip(*(torch.autograd.grad(model(x), params, g) for x, g in zip(xs, gs)))]
    for p, w in zip(params, want):
        assert_close(p.grad, w)
    assert all(t.grads == [] for plan in plans for t in plan.tasks)


def test_gpipe_bw_runs_w_once_per_stage_and_keeps_one_event_per_microbatch():
    torch.manual_seed(0)
    model = mlp()
    pipe = GPipe(model, partitions=2, chunks=4, schedule="gpipe-bw", checkpoint="never")
    pipe.train_step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss)
    for k in range(2):
        w = sorted((e.start, e.end) for e in pipe.timeline.events if e.stage == k and e.kind == "W")
        assert len(w) == 4 and all(a[1] == pytest.approx(b[0]) for a, b in zip(w, w[1:]))  # one run
        last_b = max(e.end for e in pipe.timeline.events if e.stage == k and e.kind == "B")
        assert w[0][0] >= last_b


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "gpipe-bw"])
@pytest.mark.parametrize("M", [1, 4])
def test_split_schedules_give_the_callers_input_its_gradient(schedule, M):
    """An input that requires grad gets it (accumulated over two steps), as under gpipe/1f1b."""
    torch.manual_seed(0)
    x0, y = torch.randn(8, 8), torch.randn(8, 8)
    x = x0.clone().requires_grad_()
    F.mse_loss(mlp()(x), y).backward()
    want = 2 * x.grad
    x = x0.clone().requires_grad_()
    pipe = GPipe(mlp(), partitions=2, chunks=M, schedule=schedule)
    pipe.train_step(x, y, F.mse_loss)
    pipe.train_step(x, y, F.mse_loss)
    assert x.grad is not None
    assert_close(x.grad, want)


@pytest.mark.parametrize("schedule", ["gpipe-bw", "zb-h1", "zb-h2"])
def test_a_first_stage_with_nothing_to_train_splits_its_backward(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    plain = nn.Sequential(*[nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)])
    plain.load_state_dict(model.state_dict())
    plain[0].requires_grad_(False)
    F.mse_loss(plain(x), y).backward()
    loss = GPipe(model, balance=[2, 1], chunks=2, schedule=schedule).train_step(x, y, F.mse_loss)
    assert torch.allclose(loss, F.mse_loss(plain(x), y), atol=1e-6)
    assert model[0].weight.grad is None
    assert torch.allclose(model[2].weight.grad, plain[2].weight.grad, atol=1e-6)

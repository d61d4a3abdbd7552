"""``random_replay="auto"`` (the default): randomness is paid for only where it is drawn.

Each pipelined run is compared with the unpipelined model drawing as the engine
promises (micro-batch i's layers of stage j inside ``microbatch_context`` with the
generator seeded ``microbatch_seed(seed, step, j, i)``): losses and gradients to 1e-5.
Local transport on CPU (stage threads share the default generator), K=2, M=4.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab import GPipe
from gpipe_lab.pipeline import (
    OptionError,
    PipelineOptions,
    StageDropout,
    UnreplayableRandomError,
    convert_dropout,
)
from gpipe_lab.pipeline.stage import replay_policy
from gpipe_lab.pipeline.stage.context import current_generator, microbatch_context, microbatch_seed
from gpipe_lab.pipeline.stage.random_replay import RandomReplay
from gpipe_lab.pipeline.stage.replay_policy import ALL, DISPATCH, FORK, GUARD, NONE, PROBE, StageReplay

pytestmark = pytest.mark.timeout(120)
SEED, BALANCE, CHUNKS = 17, [3, 3], 4


class Noise(nn.Module):
    """Functional draws in ``forward`` (``torch.rand`` and ``F.dropout``), while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = True

    def forward(self, x: Tensor) -> Tensor:
        if not self.active:
            return x
        return F.dropout(x, 0.3, self.training) * (1.0 + 0.1 * torch.rand(x.shape))


def dropout_only() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(),
                         nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 4))


def functional_in_stage_1() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(),
                         nn.Linear(16, 16), Noise(), nn.Linear(16, 4))


def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def reference(make: Callable[[], nn.Sequential], step: int = 0, grad: bool = True) -> tuple[Tensor, list[Tensor]]:
    """The unpipelined model's outputs (and gradients), drawing from the engine's generators."""
    net = make()
    convert_dropout(net)
    stages = [net[:BALANCE[0]], net[BALANCE[0]:]]
    x, y = batch()
    outs = []
    with torch.set_grad_enabled(grad):
        for i, (xi, yi) in enumerate(zip(x.chunk(CHUNKS), y.chunk(CHUNKS))):
            h = xi
            for j, stage in enumerate(stages):
                with microbatch_context(torch.Generator().manual_seed(microbatch_seed(SEED, step, j, i))):
                    h = stage(h)
            outs.append(h.detach())
            if grad:
                (F.mse_loss(h, yi) * (len(yi) / len(y))).backward()
    return torch.cat(outs), [p.grad.clone() for p in net.parameters()] if grad else []


def pipe_of(net: nn.Sequential, checkpoint: str = "always", **options: object) -> GPipe:
    return GPipe(net, balance=BALANCE, chunks=CHUNKS, checkpoint=checkpoint, seed=SEED, threads_per_stage=1,
                 retain_cpu_memory=False, **options)


@pytest.fixture
def dispatched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the ops that went through the per-op replay mode."""
    seen = [0]
    original = RandomReplay.__torch_dispatch__

    def counting(self: RandomReplay, *args: object, **kwargs: object) -> object:
        seen[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RandomReplay, "__torch_dispatch__", counting)
    return seen


def assert_grads(net: nn.Sequential, expected: list[Tensor]) -> None:
    for p, g in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=0)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_model_drawing_only_through_nn_dropout_never_enters_the_dispatch_mode(
        checkpoint: str, dispatched: list[int]) -> None:
    net = dropout_only()
    pipe = pipe_of(net, checkpoint)
    loss = pipe.train_step(*batch(), F.mse_loss)
    grads = [p.grad.clone() for p in net.parameters()]
    assert [list(s.replay.draws.values()) for s in pipe.stages] == [[False], [False]]  # probed once, clean
    pipe.train_step(*batch(), F.mse_loss)  # a guarded step after the probe
    assert dispatched[0] == 0
    out, expected = reference(dropout_only)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, F.mse_loss(out, batch()[1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_functional_draw_on_shared_cpu_generators_is_replayed(checkpoint: str, dispatched: list[int]) -> None:
    """Step 0 probes (the shared generators reseeded under a lock), step 1 runs stage 1 only
    through the per-op mode; both draw what the reference draws."""
    net = functional_in_stage_1()
    pipe = pipe_of(net, checkpoint)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    grads = []
    for _ in range(2):
        net.zero_grad()
        pipe.train_step(*batch(), F.mse_loss)
        grads.append([p.grad.clone() for p in net.parameters()])
        assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is left alone
    assert [list(s.replay.draws.values()) for s in pipe.stages] == [[False], [True]]  # the mode in stage 1 only
    assert dispatched[0] > 0
    for step in (0, 1):
        for g, e in zip(grads[step], reference(functional_in_stage_1, step)[1]):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


def test_a_draw_appearing_after_the_probe_raises_naming_the_stage_and_the_fix() -> None:
    net = functional_in_stage_1()
    net[4].active = False  # draws nothing at the first step
    pipe = pipe_of(net)
    pipe.train_step(*batch(), F.mse_loss)
    net[4].active = True
    # checked once per step: both guarded stages are named, with the step and the fix
    with pytest.raises(UnreplayableRandomError, match=r"stages 0, 1\b.*step 1.*random_replay=True"):
        pipe.train_step(*batch(), F.mse_loss)


class _Gate(nn.Module):
    """Stage 0's second forward of a step waits (bounded) until stage 1 has drawn."""

    def __init__(self, drawn: threading.Event) -> None:
        super().__init__()
        self.drawn, self.calls, self.armed = drawn, 0, False

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.armed and self.calls % 2 == 0:
            assert self.drawn.wait(10)
        return x


class _DrawThenSignal(nn.Module):
    def __init__(self, drawn: threading.Event) -> None:
        super().__init__()
        self.drawn, self.armed = drawn, False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            x = x + torch.rand(x.shape)
            self.drawn.set()
        return x


def test_a_draw_during_another_stages_forward_names_both_stages() -> None:
    """Two threads share the default generator: the step's guard cannot tell which stage drew,
    and says so instead of blaming one."""
    drawn = threading.Event()
    gate, draw = _Gate(drawn), _DrawThenSignal(drawn)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), gate, draw, nn.Linear(8, 4))
    pipe = GPipe(net, balance=[2, 2], chunks=2, checkpoint="never", seed=SEED, threads_per_stage=1, timeout=30)
    pipe.train_step(*batch(), F.mse_loss)  # the probe: nothing drawn
    gate.armed = draw.armed = True
    with pytest.raises(UnreplayableRandomError,
                       match=r"one of stages 0, 1 \(their forwards ran in the same step\)"):
        pipe.train_step(*batch(), F.mse_loss)


def test_explicit_true_replays_every_forward_through_the_mode(dispatched: list[int]) -> None:
    net = dropout_only()
    pipe_of(net, random_replay=True).train_step(*batch(), F.mse_loss)
    assert dispatched[0] > 0
    assert_grads(net, reference(dropout_only)[1])


def test_explicit_false_neither_probes_nor_dispatches(dispatched: list[int]) -> None:
    net = dropout_only()
    pipe = pipe_of(net, random_replay=False)
    pipe.train_step(*batch(), F.mse_loss)
    assert dispatched[0] == 0 and [s.replay.draws for s in pipe.stages] == [{}, {}]
    assert_grads(net, reference(dropout_only)[1])  # nn.Dropout is still replayed


def test_mc_dropout_under_no_grad_draws_fresh_numbers_every_call() -> None:
    pipe = pipe_of(dropout_only())
    pipe.train()
    x, _ = batch()
    with torch.no_grad():
        first, second = pipe(x), pipe(x)
    assert not torch.equal(first, second)
    torch.testing.assert_close(first, reference(dropout_only, step=0, grad=False)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(second, reference(dropout_only, step=1, grad=False)[0], atol=1e-5, rtol=0)


def test_a_stage_owning_its_generators_forks_and_reseeds_them() -> None:
    """Where a rank is alone in its process: the default generator, reseeded for the micro-batch,
    draws what the mode's micro-batch generator draws, and is restored afterwards."""
    replay = StageReplay("auto", torch.device("cpu"), ALL, nn.Sequential(), 0)
    assert replay.first_kind(True) == FORK
    state = torch.get_rng_state()
    with replay.forward(FORK, 5, False, True):
        drawn = torch.rand(6)
        assert current_generator() is torch.default_generator
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(drawn, torch.rand(6, generator=torch.Generator().manual_seed(5)))


def test_a_probe_tells_stage_dropout_draws_from_other_draws_per_training_flag() -> None:
    shared = StageReplay("auto", torch.device("cpu"), NONE, nn.Sequential(), 0)
    state = torch.get_rng_state()
    for training, draw in ((True, lambda: None), (False, lambda: torch.rand(1))):
        assert shared.first_kind(training) == PROBE
        with shared.forward(PROBE, 5, False, training):
            StageDropout(0.5)(torch.ones(8))  # drawn from the reseeded shared generator, bracketed
            draw()
    assert torch.equal(torch.get_rng_state(), state)  # reseeded for the forward, then restored
    shared.settle()
    assert shared.first_kind(True) == GUARD and shared.first_kind(False) == DISPATCH


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_random_replay_value_names_it_and_the_allowed_ones(value: object) -> None:
    assert PipelineOptions().random_replay == "auto"
    with pytest.raises(OptionError, match=r"^random_replay: must be one of \['auto', True, False\], got "):
        PipelineOptions(random_replay=value).check()


def test_a_guarded_forward_makes_its_generator_only_when_it_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the probe step, a forward of a model without dropout makes no generator; one with
    ``StageDropout`` makes one per forward, at its first draw (and draws as before)."""
    made: list[int] = []
    original = torch.Generator

    def counting(*args: object, **kwargs: object) -> torch.Generator:
        made.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    x, y = batch()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                          nn.Linear(16, 4))
    for model, per_step in ((plain, 0), (dropout_only(), 2 * CHUNKS)):
        pipe = GPipe(model, balance=BALANCE, chunks=CHUNKS, checkpoint="never", seed=SEED)
        pipe.train_step(x, y, F.mse_loss)  # the probe step
        made.clear()
        monkeypatch.setattr(torch, "Generator", counting)
        pipe.train_step(x, y, F.mse_loss)
        monkeypatch.setattr(torch, "Generator", original)
        assert {r.replay.first_kind(r.mode) for r in pipe.stages} == {GUARD}  # the step ran guarded
        assert len(made) == per_step


def test_a_guarded_step_reads_the_shared_generator_twice_not_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that draws nothing pays for the guard once per step (before and after), not per forward."""
    pipe = pipe_of(dropout_only(), "always")
    pipe.train_step(*batch(), F.mse_loss)  # the probe
    reads = []
    monkeypatch.setattr(replay_policy, "_state_bytes", lambda g: reads.append(g) or g.get_state().numpy().tobytes())
    pipe.train_step(*batch(), F.mse_loss)  # guarded: 2 stages x 4 forwards x 2 (with the replays: more)
    assert len(reads) == 2 and all(g is torch.default_generator for g in reads)


def test_one_guarded_stage_is_named_alone() -> None:
    net = functional_in_stage_1()
    net[4].active = False
    pipe = GPipe(net, balance=[len(net)], chunks=2, checkpoint="never", seed=SEED, threads_per_stage=1)
    pipe.train_step(*batch(), F.mse_loss)
    net[4].active = True
    with pytest.raises(UnreplayableRandomError, match=r"^stage 0 drew random numbers .* step 1\b"):
        pipe.train_step(*batch(), F.mse_loss)

"""The per-action path: what is derived once per schedule, the mailbox's per-key wake-up, the
stage's direct backward call and the timeline built when read."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe_lab import GPipe
from gpipe_lab.pipeline.stage.runtime import stage_backward
from gpipe_lab.pipeline.step import step_state
from gpipe_lab.pipeline.step.mailbox import Mailbox

pytestmark = pytest.mark.timeout(60)


def test_message_keys_are_derived_once_per_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), partitions=2, chunks=4, schedule="1f1b")
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    calls: list[int] = []
    original = step_state.incoming
    monkeypatch.setattr(step_state, "incoming", lambda a, s: calls.append(1) or original(a, s))
    pipe.train_step(x, y, F.mse_loss)
    assert len(calls) == 2 * 2 * 4  # every action of the schedule, once
    pipe.train_step(x, y, F.mse_loss)
    pipe.train_step(x[:6], y[:6], F.mse_loss)  # the same M: the same schedule
    assert len(calls) == 2 * 2 * 4


def test_a_put_wakes_the_waiter_of_its_key_only() -> None:
    box = Mailbox()
    got: dict[str, tuple] = {}
    ready = threading.Barrier(3)

    def wait(name: str, key: tuple) -> None:
        ready.wait(10)
        got[name] = box.get(key, 30.0)

    threads = [threading.Thread(target=wait, args=(n, ("F", 1, i))) for i, n in enumerate("ab")]
    for t in threads:
        t.start()
    ready.wait(10)
    box.put(("F", 1, 1), ("for b",))
    threads[1].join(10)
    assert got == {"b": ("for b",)} and threads[0].is_alive()
    box.put(("F", 1, 0), ("for a",))
    threads[0].join(10)
    assert got == {"a": ("for a",), "b": ("for b",)}


def test_stage_backward_matches_torch_and_keeps_its_errors() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.randn(5, 3, requires_grad=True)
    g = torch.randn(5, 2)
    stage_backward([layer(x)], [g])
    ours = (layer.weight.grad.clone(), x.grad.clone())
    layer.zero_grad()
    x.grad = None
    torch.autograd.backward([layer(x)], [g])
    assert torch.equal(ours[0], layer.weight.grad) and torch.equal(ours[1], x.grad)
    layer.zero_grad()
    stage_backward([layer(x).sum()], None)  # a loss: its gradient is one
    assert torch.allclose(layer.bias.grad, torch.full((2,), 5.0))
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        stage_backward([layer(x)], None)
    with pytest.raises(RuntimeError):  # a gradient of the wrong shape: the engine's own check
        stage_backward([layer(x)], [torch.randn(4, 2)])


def test_the_timeline_is_the_last_steps_also_when_read_late() -> None:
    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), partitions=2, chunks=2, checkpoint="never")
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.train_step(x, y, F.mse_loss)
    pipe.train_step(x, y, F.mse_loss, step=7)
    second = pipe.timeline
    assert second is not None and pipe.timeline is second
    assert sorted((e.stage, e.kind, e.microbatch) for e in second.events if e.kind != "wait") == sorted(
        (s, k, m) for s in range(2) for k in "FB" for m in range(2))
    assert all(second.start <= e.start <= e.end <= second.end for e in second.events)

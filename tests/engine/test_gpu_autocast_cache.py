"""Autocast entered once per stage thread: a weight is cast once per step, not per layer call.

Autocast caches the low-precision copy of each parameter until the outermost
autocast region of the thread exits. The caller's region is re-entered once in
each stage thread, so every micro-batch (and every replay) of a stage reuses one
cast of each weight: the graphs of all micro-batches share one cast node. A
region per layer call (what per-layer hooks do) exits after every call and
casts again each time; the second test shows the difference is visible here.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline import GPipe


def _cast_node(output: torch.Tensor, weight: nn.Parameter) -> Any:
    """The autograd node that cast ``weight`` for ``output`` (None without a graph)."""
    todo, seen = [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for child, _ in node.next_functions:
            if type(child).__name__ == "AccumulateGrad" and child.variable is weight:
                return node
            todo.append(child)
    return None


def _watch(model: nn.Sequential) -> dict[int, list[Any]]:
    """Per Linear layer, the weight-cast node of each call that built a graph."""
    nodes: dict[int, list[Any]] = {}
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Linear):

            def hook(module: nn.Module, args: Any, out: torch.Tensor, i: int = i) -> None:
                node = _cast_node(out, module.weight)
                if node is not None:
                    nodes.setdefault(i, []).append(node)

            layer.register_forward_hook(hook)
    return nodes


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_each_stage_casts_each_weight_once_per_step(checkpoint: str) -> None:
    model = _model()
    nodes = _watch(model)
    pipe = GPipe(model, partitions=2, chunks=4, checkpoint=checkpoint)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.train_step(
            torch.randn(8, 8), torch.randn(8, 2), lambda o, t: nn.functional.mse_loss(o.float(), t)
        )
    assert set(nodes) == {0, 2, 4}
    for i, calls in nodes.items():
        assert len(calls) == 4, (i, len(calls))  # every micro-batch's graph (replays for "always")
        assert len({id(n) for n in calls}) == 1, f"layer {i}: weight cast {len(set(map(id, calls)))} times"


def test_a_region_per_layer_call_casts_again_each_call() -> None:
    model = _model()
    nodes = _watch(model)
    stacks: list[ExitStack] = []

    def enter(module: nn.Module, args: Any) -> None:
        stacks.append(ExitStack())
        stacks[-1].enter_context(torch.autocast("cpu", dtype=torch.bfloat16))

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        stacks.pop().close()

    for layer in model:
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    GPipe(model, partitions=1, chunks=4).train_step(
        torch.randn(8, 8), torch.randn(8, 2), lambda o, t: nn.functional.mse_loss(o.float(), t)
    )
    assert all(len({id(n) for n in calls}) == 4 for calls in nodes.values())

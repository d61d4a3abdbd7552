"""Probe: would batching weight gradients across micro-batches pay on this CPU?

The 8-block MLP, M micro-batches, one thread. Its ``nn.Linear`` layers are run
through a Function whose backward returns only the input gradient and keeps
(input, grad_output); the weight gradients are then computed either once over
all micro-batches (one GEMM over the whole batch) or per micro-batch fused
into the accumulation (``addmm_``). Compared, alternately in the same rounds,
with plain autograd on the full batch and on the micro-batches. The probe
checks the gradients against plain autograd first.

    python -m benchmarks.probes.weight_grad_batching [M] [rounds]   # from the repository root; the first round warms up
"""

from __future__ import annotations

if not __package__:  # started as a file (``python benchmarks/probes/weight_grad_batching.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.bench_common import probe_mlp
from gpipe_lab.pipeline.measuring.call_timing import time_rounds

STASH: dict[int, list[tuple[Tensor, Tensor]]] = {}


class InputGradLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input gradient and stashes what the weight needs."""

    @staticmethod
    def forward(ctx, inputs: Tensor, weight: Tensor, bias: Tensor, key: int) -> Tensor:  # noqa: ANN001
        ctx.save_for_backward(inputs, weight)
        ctx.key = key
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple:  # noqa: ANN001
        inputs, weight = ctx.saved_tensors
        STASH.setdefault(ctx.key, []).append((inputs, grad_out))
        return (grad_out @ weight if ctx.needs_input_grad[0] else None), None, None, None


def main() -> None:
    chunks, rounds, work = probe_mlp(sys.argv[1:])
    model, x, y, loss_fn = work.module, work.inputs, work.targets, work.loss_fn
    linears = [m for m in model if isinstance(m, nn.Linear)]

    def deferred_forward(value: Tensor) -> Tensor:
        for layer in model:
            value = (InputGradLinear.apply(value, layer.weight, layer.bias, id(layer))
                     if isinstance(layer, nn.Linear) else layer(value))
        return value

    def micro_backward() -> None:
        for a, b in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(deferred_forward(a), b) / chunks).backward()

    def batched() -> None:
        micro_backward()
        for layer in linears:
            pairs = STASH.pop(id(layer))
            grads = torch.cat([g for _, g in pairs])
            layer.weight.grad = grads.t() @ torch.cat([i for i, _ in pairs])
            layer.bias.grad = grads.sum(0)

    def fused() -> None:
        for a, b in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(deferred_forward(a), b) / chunks).backward()
            for layer in linears:
                (inputs, grads), = STASH.pop(id(layer))
                if layer.weight.grad is None:
                    layer.weight.grad, layer.bias.grad = grads.t() @ inputs, grads.sum(0)
                else:
                    layer.weight.grad.addmm_(grads.t(), inputs)
                    layer.bias.grad.add_(grads.sum(0))

    def plain_full() -> None:
        loss_fn(model(x), y).backward()

    def plain_micro() -> None:
        for a, b in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(model(a), b) / chunks).backward()

    plain_micro()
    reference = [p.grad.clone() for p in model.parameters()]
    for fn in (batched, fused):
        model.zero_grad(set_to_none=True)
        fn()
        diff = max(float((p.grad.detach() - r).abs().max()) for p, r in zip(model.parameters(), reference))
        print(f"{fn.__name__}: max |grad - autograd| = {diff:.2e}")
    fns = {"autograd, full batch": plain_full, f"autograd, {chunks} micro-batches": plain_micro,
           "weight gradients batched over micro-batches": batched, "weight gradients fused (addmm_)": fused}
    timings = time_rounds(fns, max(1, rounds - 1), 1, lambda: model.zero_grad(set_to_none=True))
    for name, timing in timings.items():
        print(f"{name:45s} {timing.median:.3f} s")


if __name__ == "__main__":
    main()

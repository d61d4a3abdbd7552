"""Per-layer costs of a layer sequence, and running a module without leaving a trace.

The one ``layer_costs`` of the lab. The engine balances stages with it
(``gpipe_lab.pipeline``) and the models give it their preset sample batch
(``gpipe_lab.planner.preset_costs``); this module imports torch only, so it
belongs to neither and both may use it.

Cost kinds:
- ``"params"``: parameter elements of the layer (a tied table counts in every layer using it);
- ``"flops"``: forward FLOPs on the sample (``torch.utils.flop_counter``: matmuls,
  convolutions, attention; elementwise ops are not counted);
- ``"activation_bytes"``: bytes autograd saves inside the layer on the sample
  (``saved_tensors_hooks``; parameters saved for backward are not activations);
- ``"output_bytes"``: bytes of the layer's output (what a stage keeps or sends);
- ``"time"``: seconds of the layer's forward and backward on the sample, in training mode
  (the median of ``repeat`` runs after one warm-up), on the device the module lives on.
  Unlike the others it varies from run to run; a distributed pipeline takes rank 0's balance.
- ``"auto"`` (``PipelineOptions``' default): ``AUTO_MEASURED`` on the sample when there is one,
  else ``"params"`` (the one cost known without running the model).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from gpipe_lab.pipeline.measuring.inplace import writable
from gpipe_lab.pipeline.measuring.saved_bytes import SavedBytes, storage_keys
from gpipe_lab.pipeline.skip.api import SkipFrame

__all__ = ["AUTO", "AUTO_MEASURED", "COST_KINDS", "MEASURED_KINDS", "layer_costs", "measure_layers", "parameter_costs",
           "untouched"]

COST_KINDS = ("params", "flops", "activation_bytes", "output_bytes", "time")
MEASURED_KINDS = COST_KINDS[1:]
#: the default cost: ``AUTO_MEASURED`` given a sample, else ``"params"``
AUTO = "auto"
#: what ``"auto"`` measures on a sample: of the kinds that cut alike on every run (``time`` does not),
#: the one whose K=2 cut trained fastest over the quick benchmark's workloads
#: (``python -m benchmarks.probes.default_cut``, ``results/default_cut.md``)
AUTO_MEASURED = "flops"


def parameter_costs(module: nn.Sequential) -> list[float]:
    """Cost of each layer = its number of parameter elements (the default c_i)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in module]


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value``, each distinct tensor object once."""
    tensors = {id(t): t for t in (value if isinstance(value, (tuple, list)) else (value,))
               if isinstance(t, Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _saved_bytes(layer: nn.Module, value: Any) -> tuple[Any, int]:
    """Run ``layer`` with grad; the bytes autograd saves that are activations (``SavedBytes``)."""
    counter = SavedBytes(storage_keys(layer.parameters()))
    with torch.enable_grad(), counter.hooks():
        out = layer(value)
    return out, counter.total


def _synchronize(value: Any) -> None:
    for t in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(t, Tensor) and t.device.type == "cuda":
            torch.cuda.synchronize(t.device)


def _timed(layer: nn.Module, value: Any) -> tuple[Any, float]:
    """Run ``layer`` forward and backward (the sum of its float outputs that need gradients) once;
    its output detached as the next layer's input (floating tensors requiring grad) and the seconds."""
    _synchronize(value)
    start = time.perf_counter()
    with torch.enable_grad():
        # the input is a leaf of its own: an in-place layer writes into its alias, as in its model
        inputs = writable(value if isinstance(value, tuple) else (value,))
        out = layer(inputs if isinstance(value, tuple) else inputs[0])
        outputs = out if isinstance(out, tuple) else (out,)
        loss = sum(t.float().sum() for t in outputs if isinstance(t, Tensor) and t.requires_grad)
        if isinstance(loss, Tensor):
            loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch's stubs
    _synchronize(out)
    seconds = time.perf_counter() - start
    detached = tuple(t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, Tensor) else t
                     for t in outputs)
    return (detached[0] if len(detached) == 1 else detached), seconds


def time_layers(module: nn.Sequential, sample: Any, repeat: int = 3) -> list[float]:
    """Seconds of each layer's forward and backward on ``sample``: the median of ``repeat`` passes
    after one warm-up pass. Run it inside ``untouched(module, train=True)`` to leave no trace.

    Raises:
        ValueError: ``repeat`` is not an integer >= 1.
    """
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"repeat must be an integer >= 1, got {repeat!r}")
    runs: list[list[float]] = [[] for _ in module]
    for n in range(repeat + 1):
        value = sample.detach().clone() if isinstance(sample, Tensor) else sample  # an in-place first layer
        # each layer back-propagates alone: a long skip reaches its pop as a leaf, as in a pipeline
        with SkipFrame({}, detach=True):
            for i, layer in enumerate(module):
                value, seconds = _timed(layer, value)
                if n:  # the first pass warms caches and allocators up
                    runs[i].append(seconds)
    return [statistics.median(r) for r in runs]


def measure_layers(module: nn.Sequential, sample: Any, kind: str) -> list[float]:
    """Run ``sample`` through ``module`` layer by layer, measuring ``kind`` for each.

    Raises:
        ValueError: ``kind`` is not one of ``MEASURED_KINDS``.
    """
    if kind not in MEASURED_KINDS:
        raise ValueError(f"unknown measured cost {kind!r}; allowed: {list(MEASURED_KINDS)}")
    if kind == "time":
        return time_layers(module, sample)
    costs: list[float] = []
    value = sample
    for layer in module:
        if kind == "flops":
            with FlopCounterMode(display=False) as counter:
                value = layer(value)
            costs.append(float(counter.get_total_flops()))
        elif kind == "output_bytes":
            value = layer(value)
            costs.append(float(_nbytes(value)))
        else:
            value, n = _saved_bytes(layer, value)
            costs.append(float(n))
    return costs


def layer_costs(module: nn.Sequential, cost: object = None, sample: Any = None) -> list[float]:
    """One cost per layer of ``module``.

    ``cost`` is ``None`` or ``"params"`` (parameter elements), ``"auto"`` (``AUTO_MEASURED`` with a
    ``sample``, else ``"params"``), a measured kind
    (``"flops"``, ``"activation_bytes"``, ``"output_bytes"``, ``"time"``: measured on
    ``sample``, with the module left as it was, see ``untouched``; ``"time"`` in training
    mode), a sequence
    of numbers, or a callable ``layer -> number``. When every cost is zero,
    each layer costs 1 (a balance by layer count).

    Raises:
        ValueError: an unknown name, a measured kind without ``sample``, a wrong
            number of costs, or a negative or non-finite cost.
    """
    if cost == AUTO:
        cost = "params" if sample is None else AUTO_MEASURED
    if cost is None or cost == "params":
        costs = parameter_costs(module)
    elif isinstance(cost, str):
        if cost not in MEASURED_KINDS:
            raise ValueError(
                f"unknown cost {cost!r}; allowed: 'auto', 'params', a list of per-layer numbers, a callable, "
                f"or one of {list(MEASURED_KINDS)} with sample=")
        if sample is None:
            raise ValueError(
                f"cost {cost!r} is measured on a sample batch: pass sample= "
                "(gpipe_lab.planner.preset_costs gives the presets' sample)")
        with untouched(module, train=True if cost == "time" else None):
            costs = measure_layers(module, sample, cost)
    elif callable(cost):
        costs = [float(cost(layer)) for layer in module]
    else:
        costs = [float(c) for c in cast(Iterable[float], cost)]  # a sequence of numbers: the last kind left
    if len(costs) != len(module):
        raise ValueError(f"got {len(costs)} layer costs for a module of {len(module)} layers")
    for i, c in enumerate(costs):
        if not (c >= 0 and math.isfinite(c)):
            raise ValueError(f"layer {i} has cost {c}; costs must be finite and non-negative")
    if sum(costs) == 0:
        costs = [1.0] * len(costs)
    return costs


@contextmanager
def untouched(module: nn.Module, train: bool | None = None) -> Iterator[None]:
    """Run a block on ``module`` and leave no trace of it.

    On exit, every parameter's values and ``.grad`` (the same tensor object, or
    ``None``), every buffer (BatchNorm running statistics, ``num_batches_tracked``,
    any accumulators), each submodule's training flag, and the CPU and CUDA RNG
    states are as on entry; inside, ``.grad`` starts at ``None``. ``train``
    sets every submodule's mode inside the block (``None``: unchanged).
    Parameters and buffers are copied, so the block needs twice their memory.
    """
    modes = [(m, m.training) for m in module.modules()]
    params = [(p, p.detach().clone(), p.grad) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({p.device.index or 0 for p, _, _ in params if p.device.type == "cuda"})
    for p, _, _ in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=devices):
            if train is not None:
                module.train(train)
            yield
    finally:
        with torch.no_grad():
            for p, value, grad in params:
                p.copy_(value)
                p.grad = grad
            for b, value in buffers:
                b.copy_(value)
        for m, mode in modes:
            m.training = mode

"""Balancing by profiling a sample batch: ``balance_by_time`` and ``balance_by_size``.

Both run the module layer by layer in training mode (forward and backward,
whatever mode the module is in) and leave it exactly as it was: parameters,
their existing ``.grad`` (kept, the same tensor), buffers such as BatchNorm
running statistics and ``num_batches_tracked``, training/eval flags and the
CPU/CUDA RNG states (``gpipe_lab.pipeline.measuring.costs.untouched``).
"""

from __future__ import annotations

from torch import Tensor, nn

from gpipe_lab.pipeline.measuring.costs import layer_costs, measure_layers, time_layers, untouched
from gpipe_lab.pipeline.partitioning.partition import balance_by_cost

__all__ = ["balance_by_size", "balance_by_time"]

Sample = Tensor | tuple[Tensor, ...]


def _check(module: nn.Sequential, sample: object, partitions: int) -> Sample:
    """The sample detached from the caller's graph.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``sample`` not a tensor (tuple).
        ValueError: ``partitions`` < 1 or more than the layers.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing needs an nn.Sequential, got {type(module).__name__}")
    if not isinstance(partitions, int) or not 1 <= partitions <= len(module):
        raise ValueError(f"partitions must be an integer in [1, {len(module)}] (the module's layers), "
                         f"got {partitions!r}")
    if isinstance(sample, Tensor):
        return sample.detach()
    if isinstance(sample, tuple) and sample and all(isinstance(t, Tensor) for t in sample):
        return tuple(t.detach() for t in sample)
    raise TypeError(f"sample must be a tensor or a tuple of tensors, got {type(sample).__name__}")


def balance_by_time(module: nn.Sequential, sample: Sample, partitions: int, repeat: int = 3) -> list[int]:
    """Layers per partition, balancing each layer's measured forward+backward time on ``sample``
    (``gpipe_lab.pipeline.measuring.costs.time_layers``: the median of ``repeat`` passes after a warm-up).

    The module is left untouched (see the module docstring); existing ``.grad``
    values are preserved.

    Raises:
        TypeError: not an ``nn.Sequential``, or ``sample`` not a tensor or tuple of tensors.
        ValueError: ``partitions`` out of range, or ``repeat`` < 1.
    """
    value = _check(module, sample, partitions)
    with untouched(module, train=True):
        times = time_layers(module, value, repeat)
    return balance_by_cost(layer_costs(module, times), partitions)


def balance_by_size(module: nn.Sequential, sample: Sample, partitions: int,
                    param_scale: float = 2.0) -> list[int]:
    """Layers per partition, balancing each layer's memory on ``sample``.

    A layer's memory is ``param_scale`` × its parameter bytes (2: weights and
    their gradients; more with optimizer state) plus the bytes autograd saves
    for its backward on ``sample`` (give a micro-batch-sized sample). The module
    is left untouched (see the module docstring).

    Raises:
        TypeError: not an ``nn.Sequential``, or ``sample`` not a tensor or tuple of tensors.
        ValueError: ``partitions`` out of range, or a negative ``param_scale``.
    """
    value = _check(module, sample, partitions)
    if not param_scale >= 0:
        raise ValueError(f"param_scale must be >= 0, got {param_scale}")
    with untouched(module, train=True):
        saved = measure_layers(module, value, "activation_bytes")
    params = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in module]
    return balance_by_cost(layer_costs(module, [param_scale * p + s for p, s in zip(params, saved)]),
                           partitions)

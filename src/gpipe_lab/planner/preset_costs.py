"""Per-layer costs of a preset model: the engine's measuring on the preset's sample, per sample.

``preset_costs(model, kind)`` returns one float per element of the ``nn.Sequential``,
per sample, measured by the lab's one ``gpipe_lab.pipeline.measuring.costs.layer_costs`` (see there
for the kinds: ``params``, ``flops``, ``activation_bytes``, ``output_bytes``, ``time``).
The bridge between the models and the engine's measuring (``gpipe_lab.models`` never imports the
engine): the sample (default: the preset's, ``models.example_input``), per-sample scaling, and a
meta replica rebuilt from ``model.spec`` when the model holds real weights, so the measurement never
allocates.
Activation bytes are measured at batch 2 and 4 and differenced, so anything
batch-independent drops out; FLOPs and output bytes are measured at batch 2.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from gpipe_lab.models import ModelSpec, build, example_input
from gpipe_lab.pipeline.measuring.costs import (
    COST_KINDS,
    layer_costs,
    measure_layers,
    parameter_costs,
    untouched,
)

__all__ = ["preset_costs"]


def _meta_model(model: nn.Sequential) -> nn.Sequential:
    if all(p.is_meta for p in model.parameters()):
        return model
    spec = getattr(model, "spec", None)
    if spec is None:
        return model
    defaults = cast(ModelSpec, build(spec.name, device="meta").spec)  # build's module carries its spec
    overrides = {k: v for k, v in spec.options.items() if defaults.options.get(k) != v}
    replica = build(spec.name, device="meta", **{k: v for k, v in overrides.items() if k != "genotype"})
    replica.train(model.training)
    return replica


def _time_costs(model: nn.Sequential, sample: Any, batch_size: int) -> list[float]:
    """Seconds per sample of each layer's forward and backward on a batch of ``batch_size`` (at least
    2: training-mode BatchNorm needs two values per channel), on the model's own weights and device."""
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        raise ValueError("cost 'time' runs the model: build it with real weights, not on the meta device")
    if sample is None:
        batch_size = max(int(batch_size), 2)
        sample = example_input(model, batch_size, params[0].device if params else "cpu")
    return [c / batch_size for c in layer_costs(model, "time", sample)]


def preset_costs(model: nn.Sequential, kind: str = "params", example_input_: Any = None,
                batch_size: int = 1) -> list[float]:
    """One cost per layer of ``model``, per sample (see the module docstring for the kinds).

    ``example_input_`` overrides the preset's sample batch (it must live on the
    model's device; FLOPs and output bytes are then for that whole batch, and
    activation bytes are divided by ``batch_size``); the model is left as it was.
    ``"time"`` runs the model itself (real weights, its device, training mode) on a batch of
    ``batch_size`` samples (give the micro-batch size: time per sample is not constant in it).
    Raises ``ValueError`` for an unknown kind, when no input can be made, or for ``"time"`` on a
    model on the meta device.
    """
    if kind not in COST_KINDS:
        raise ValueError(f"unknown cost kind {kind!r}; expected one of {COST_KINDS}")
    if kind == "params":
        return parameter_costs(model)
    if kind == "time":
        return _time_costs(model, example_input_, batch_size)
    if example_input_ is not None:
        with untouched(model):
            costs = measure_layers(model, example_input_, kind)
        return costs if kind != "activation_bytes" else [c / batch_size for c in costs]
    meta = _meta_model(model)
    device = next(meta.parameters()).device
    if kind == "flops":
        # the counted ops (matmuls, convolutions, attention) are the same in eval mode, where the meta
        # BatchNorm is a cheaper decomposition; ``untouched`` restores every module's mode
        with untouched(meta, train=False):
            return [c / 2 for c in measure_layers(meta, example_input(meta, 2, device), kind)]
    # Batches of 2 and 4 (training-mode BatchNorm needs more than one value per channel).
    two = measure_layers(meta, example_input(meta, 2, device), kind)
    if kind != "activation_bytes":
        return [c / 2 for c in two]
    four = measure_layers(meta, example_input(meta, 4, device), kind)
    return [(b - a) / 2 for a, b in zip(two, four)]

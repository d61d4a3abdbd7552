"""Per-layer costs of a flat layer sequence, for balancing pipeline stages.

``layer_costs(model, kind)`` returns one float per element of the ``nn.Sequential``:
- ``"params"``: parameters of the layer (a tied table counts in every layer using it);
- ``"flops"``: forward FLOPs for ``example_input`` (default: one sample from the
  model's preset), counted from shapes with ``torch.utils.flop_counter`` on the
  meta device (matmuls, convolutions, attention; elementwise ops are not counted);
- ``"activation_bytes"``: bytes autograd saves for backward inside the layer,
  per sample: measured with ``saved_tensors_hooks`` at batch 2 and 4 on the meta
  device and differenced, so saved parameters (batch-independent) drop out;
- ``"output_bytes"``: bytes per sample of the layer's output (the boundary
  activation a pipeline stage keeps or sends).
Measurements run on a meta replica rebuilt from ``model.spec`` when the model
holds real weights, so they never allocate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["layer_costs", "example_input", "COST_KINDS"]

COST_KINDS = ("params", "flops", "activation_bytes", "output_bytes")


def example_input(model: nn.Module, batch_size: int = 1, device: str | torch.device = "meta") -> Any:
    """A batch for ``model`` built by ``build``: images ``[B,3,H,W]``, ``(src, tgt_in)`` or tokens.

    Raises ``ValueError`` if the model has no ``spec`` (was not made by ``build``).
    """
    spec = getattr(model, "spec", None)
    if spec is None:
        raise ValueError("model has no .spec (not built by gpipe_lab.models.build); pass example_input")
    o = spec.options
    if spec.family == "amoebanet":
        return torch.randn(batch_size, 3, o["image_size"], o["image_size"], device=device)
    tokens = torch.randint(4, o["vocab_size"], (batch_size, o["seq_len"]), device=device)
    return tokens if o["layout"] == "decoder_only" else (tokens, tokens.clone())


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value``, each distinct tensor object once."""
    tensors = {id(t): t for t in (value if isinstance(value, (tuple, list)) else (value,))
               if isinstance(t, Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _meta_model(model: nn.Sequential) -> nn.Sequential:
    if all(p.is_meta for p in model.parameters()):
        return model
    spec = getattr(model, "spec", None)
    if spec is None:
        return model
    from gpipe_lab.models.registry import build

    defaults = build(spec.name, device="meta")
    overrides = {k: v for k, v in spec.options.items() if defaults.spec.options.get(k) != v}
    replica = build(spec.name, device="meta", **{k: v for k, v in overrides.items() if k != "genotype"})
    replica.train(model.training)
    return replica


def _measure(model: nn.Sequential, batch: Any, kind: str) -> list[float]:
    costs: list[float] = []
    value = batch
    for layer in model:
        if kind == "flops":
            with FlopCounterMode(display=False) as counter:
                value = layer(value)
            costs.append(float(counter.get_total_flops()))
        elif kind == "output_bytes":
            value = layer(value)
            costs.append(float(_nbytes(value)))
        else:
            saved: list[int] = []

            def pack(t: Tensor, saved: list[int] = saved) -> Tensor:
                saved.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                value = layer(value)
            costs.append(float(sum(saved)))
    return costs


def layer_costs(model: nn.Sequential, kind: str = "params", example_input_: Any = None,
                batch_size: int = 1) -> list[float]:  # costs per sample unless example_input_ is given
    """One cost per layer of ``model`` (see the module docstring for the kinds).

    ``example_input_`` overrides the preset's sample batch (it must live on the
    model's device; FLOPs and output bytes are then for that whole batch, and
    activation bytes are divided by ``batch_size``). Raises ``ValueError`` for an
    unknown kind or when no input can be made.
    """
    if kind not in COST_KINDS:
        raise ValueError(f"unknown cost kind {kind!r}; expected one of {COST_KINDS}")
    if kind == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in model]
    if example_input_ is not None:
        costs = _measure(model, example_input_, kind)
        return costs if kind != "activation_bytes" else [c / batch_size for c in costs]
    meta = _meta_model(model)
    device = next(meta.parameters()).device
    # Batches of 2 and 4 (training-mode BatchNorm needs more than one value per channel).
    two = _measure(meta, example_input(meta, 2, device), kind)
    if kind != "activation_bytes":
        return [c / 2 for c in two]
    four = _measure(meta, example_input(meta, 4, device), kind)
    return [(b - a) / 2 for a, b in zip(two, four)]

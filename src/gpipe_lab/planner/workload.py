"""The workloads the planner profiles and tries: a network, one mini-batch, its loss and a balance.

- ``WorkloadSpec``: a ``models.build`` preset with size overrides and a mini-batch, as the
  experiment configs give it; ``build(K)`` makes the ``Workload``, balanced by per-layer FLOPs
  (as Lingvo balances).
- ``tiny_linear``: 4 × Linear(4, 4), almost no compute per action (the engine's own cost per action).

The benchmarks and experiments time these workloads too.

Each builder seeds torch first: two builds give the same weights and the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.models import ModelSpec, build, example_input, translation_loss
from gpipe_lab.pipeline import balance_by_cost
from gpipe_lab.planner.preset_costs import preset_costs

Inputs = Tensor | tuple[Tensor, ...]
#: ``loss_fn(output, targets)``: the engine hands it micro-batches it types as ``object``
Loss = Callable[[Any, Any], Tensor]


@dataclass
class Workload:
    """A module to pipeline with one mini-batch, its targets, a loss and a balance."""

    name: str
    module: nn.Sequential
    inputs: Inputs
    targets: Tensor
    loss_fn: Loss
    balance: list[int]
    info: dict[str, object] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        """Samples in the mini-batch."""
        return int(self.targets.shape[0])

    def to(self, device: torch.device | str) -> Workload:
        """The same workload with module, inputs and targets on ``device``."""
        inputs = tuple(t.to(device) for t in self.inputs) if isinstance(self.inputs, tuple) \
            else self.inputs.to(device)
        return Workload(self.name, self.module.to(device), inputs, self.targets.to(device), self.loss_fn,
                        self.balance, self.info)


def mse(output: Any, target: Tensor) -> Tensor:
    """Mean squared error of a regression workload's output against its targets."""
    return F.mse_loss(output, target)


def tiny_linear(batch: int, layers: int = 4, partitions: int = 2, seed: int = 0) -> Workload:
    """``layers`` × Linear(4, 4) on a random batch (MSE): the engine's work dominates each action.

    Raises:
        ValueError: ``partitions`` outside 1..``layers``.
    """
    if not 1 <= partitions <= layers:
        raise ValueError(f"partitions must be in 1..{layers}, got {partitions}")
    torch.manual_seed(seed)
    module = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    balance = [layers // partitions + (k < layers % partitions) for k in range(partitions)]
    return Workload("tiny", module, torch.randn(batch, 4), torch.randn(batch, 4), mse, balance, {"batch": batch})


_FLOPS: dict[tuple, list[float]] = {}


@dataclass(frozen=True)
class WorkloadSpec:
    """A ``models.build`` preset with size overrides and a mini-batch size, named ``name``."""

    name: str
    preset: str
    sizes: dict[str, Any]
    batch: int

    @property
    def key(self) -> tuple:
        """The network's identity (preset and sizes), for caching what depends only on it."""
        return (self.preset, tuple(sorted((k, repr(v)) for k, v in self.sizes.items())))

    def model(self, seed: int = 0) -> nn.Sequential:
        """The network with fresh weights drawn from ``seed``.

        Raises:
            ValueError: invalid preset or sizes (from ``models.build``).
        """
        torch.manual_seed(seed)
        return build(self.preset, "cpu", **self.sizes)

    def balance(self, model: nn.Sequential, partitions: int) -> list[int]:
        """The balance ``GPipe(model, partitions=K, cost=<per-layer FLOPs>)`` chooses.

        The per-layer FLOPs, which take a second or more to count, are counted once per network.

        Raises:
            ValueError: more partitions than layers (from ``balance_by_cost``).
        """
        if partitions == 1:
            return [len(model)]
        return balance_by_cost(self.flops(model), partitions)

    def flops(self, model: nn.Sequential | None = None) -> list[float]:
        """Per-layer forward FLOPs per sample (``preset_costs(..., "flops")``), counted once per network.

        Raises:
            ValueError: invalid preset or sizes (from ``models.build``).
        """
        if self.key not in _FLOPS:
            _FLOPS[self.key] = list(preset_costs(model if model is not None else self.model(), "flops"))
        return _FLOPS[self.key]

    def build(self, partitions: int = 1, seed: int = 0) -> Workload:
        """The workload: images with class labels (AmoebaNet) or tokens with next-token targets.

        Raises:
            ValueError: invalid preset or sizes, more partitions than layers, or a model without a ModelSpec.
        """
        model = self.model(seed)
        torch.manual_seed(seed)
        x = example_input(model, self.batch, "cpu")
        spec = getattr(model, "spec", None)
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"workload {self.name!r}: preset {self.preset!r} built a model without a ModelSpec")
        options = spec.options
        if spec.family == "amoebanet":
            y = torch.randint(0, int(options.get("num_classes", 1000)), (self.batch,))
            loss: Loss = F.cross_entropy
        else:
            y = (x[0] if isinstance(x, tuple) else x).roll(-1, dims=1)
            loss = translation_loss()
        return Workload(self.name, model, x, y, loss, self.balance(model, partitions),
                        {"preset": self.preset, "batch": self.batch, **options})

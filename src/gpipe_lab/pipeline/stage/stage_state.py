"""What a stage keeps per step and per micro-batch: the step's plan, and each micro-batch's saved state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from gpipe_lab.pipeline.devices.assignment import to_device
from gpipe_lab.pipeline.stage.checkpointing import AutocastState
from gpipe_lab.pipeline.stage.replay_policy import OFF
from gpipe_lab.pipeline.stage.weight_gradients import SplitPlan

LossFn = Callable[[Any, Any], Tensor]  # (micro-batch output, its target): any loss function's types


@dataclass
class StepPlan:
    """What a stage needs to know about the current step."""

    step: int
    num_microbatches: int
    checkpointed: frozenset[int]
    #: (stage, micro-batch) pairs whose B leaves the weight gradients to a W: a schedule may split
    #: a micro-batch's backward on one stage and not on another (dualpipev)
    split_backward: frozenset[tuple[int, int]] = frozenset()
    # {stage: {mb: the consecutive W run it belongs to}}: a run's W is done at once, at its last W
    weight_runs: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)
    loss_fn: LossFn | None = None
    loss_weights: list[float | Tensor] = field(default_factory=list)  # Tensor: see batching.loss_weights
    # False for forward-only (evaluation) steps: grad mode is per thread, so the
    # caller's no_grad/inference_mode does not reach the stage workers by itself.
    grad_enabled: bool = True


@dataclass
class SavedMicrobatch:
    """One micro-batch's state on a stage, from its forward until its (weight) backward ends."""

    inputs: tuple[Tensor, ...]
    was_tensor: bool
    target: object = None
    outputs: tuple[Tensor, ...] | None = None
    grads: tuple[Tensor | None, ...] | None = None
    saved_bytes: int = 0
    split: SplitPlan | None = None
    own_input_grads: bool = True  # False: the first stage's input only marks where its graph ends
    # the forward drew no random number: its replay, on the same inputs, draws none either,
    # so it runs without the per-op replay mode (which costs a Python call per op)
    drew_nothing: bool = False
    replay: str = OFF  # how its first forward replayed its draws (``replay_policy``), and so its replay
    autocast: AutocastState | None = None  # the first forward's, for its replay (checkpointed only)

    def clear(self) -> None:
        """Drop the graph. With memory tracking the graph holds the pack hook, whose closure holds
        this object: a cycle through C++ that Python's GC cannot see. A plain backward frees the
        graph's buffers and breaks it; a graph kept for a split W (``retain_graph``) is only freed
        here (otherwise ~25 MB/step leaks on the MLP under zb-h1)."""
        self.outputs = self.grads = self.split = self.target = None
        self.inputs = ()


def weighted(loss: Tensor, weight: float | Tensor) -> Tensor:
    """``loss`` times its micro-batch's weight, in the loss's dtype (a weight tensor, kept on the
    device so the host never reads it, is moved to the loss's device)."""
    if isinstance(weight, Tensor):
        return (loss * to_device(weight, loss.device)).to(loss.dtype)
    return loss * weight

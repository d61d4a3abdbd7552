"""Peak memory of each stage of a plan, as the engine tracks it, walked along the schedule's action lists.

A stage's memory is its parameter state plus its peak live activation bytes:

- parameter state: parameters x ``bytes_per_param`` (weights, gradients and optimizer slots: 16 for
  Adam in float32, 12 for SGD with momentum, 8 without);
- activations, counted as the engine counts them (``StageRuntime``, ``gpipe_lab.pipeline.measuring.saved_bytes``): a
  forward ``F`` of micro-batch i keeps the stage's boundary inputs (I bytes per sample) and, unless i is
  checkpointed, what autograd saves inside the stage (S per sample); a replay ``R`` before a
  checkpointed micro-batch's ``B`` adds S again; ``B`` frees both, or the following ``W`` does when the
  schedule splits the backward. The peak over the stage's list is the stage's figure.

I and S per sample come from ``capacity.layer_records`` (meta device, one-sample batches), so a plan's
memory costs no run; S of a micro-batch also holds the stage's ``fixed`` bytes, saved once per call
whatever its size (BatchNorm's per-channel statistics). Not counted (as in the engine): boundary gradients in flight, the outputs sent to
the next stage, allocator slack, kernel workspaces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from gpipe_lab.pipeline.schedules import Schedule
from gpipe_lab.pipeline.step.batching import checkpointed_microbatches
from gpipe_lab.planner.capacity import LayerMemory, partition_bytes

__all__ = ["StageMemoryModel", "activation_peaks"]


def activation_peaks(plan: Schedule, inputs: Sequence[float], internals: Sequence[float], samples: float,
                     checkpoint: str, fixed: Sequence[float] | None = None) -> list[float]:
    """Each stage's peak live activation bytes along ``plan`` (see the module docstring); ``inputs`` and
    ``internals`` are each stage's I and S per sample, ``fixed`` its saved bytes per call, ``samples``
    the micro-batch size.

    Raises:
        ValueError: an unknown checkpoint mode, or per-stage lists of the wrong length.
    """
    if not len(plan) == len(inputs) == len(internals):
        raise ValueError(f"{len(plan)} stages in the schedule, {len(inputs)} inputs, {len(internals)} internals")
    m = 1 + max((a.microbatch for actions in plan for a in actions), default=0)
    fixed = fixed or [0.0] * len(plan)
    replayed = checkpointed_microbatches(checkpoint, m)
    peaks = []
    for k, actions in enumerate(plan):
        split = {a.microbatch for a in actions if a.kind == "W"}
        held: dict[int, float] = {}
        live = peak = 0.0
        inside = internals[k] * samples + fixed[k]
        for a in actions:
            i = a.microbatch
            if a.kind == "F":
                held[i] = inputs[k] * samples + (0.0 if i in replayed else inside)
                live += held[i]
            elif a.kind == "B" and i in replayed:
                held[i] += inside  # the replay before B
                live += inside
            peak = max(peak, live)
            if (a.kind == "B" and i not in split) or a.kind == "W":
                live -= held.pop(i, 0.0)
        peaks.append(peak)
    return peaks


class StageMemoryModel:
    """Per-stage memory of plans over one model's layer records (see the module docstring)."""

    def __init__(self, records: Sequence[LayerMemory], bytes_per_param: float,
                 fixed_bytes: Sequence[float] | None = None) -> None:
        self.records = tuple(records)
        self.bytes_per_param = float(bytes_per_param)
        self.fixed_bytes = tuple(fixed_bytes or [0.0] * len(self.records))
        if len(self.fixed_bytes) != len(self.records):
            raise ValueError(f"{len(self.fixed_bytes)} fixed byte counts for {len(self.records)} layers")

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one model per instance, instances are short-lived
    def _chain(self, start: int, count: int) -> tuple[float, float, float, float]:
        """(I, S, parameter state bytes, fixed bytes) of layers ``start`` .. ``start + count - 1``."""
        chain = self.records[start:start + count]
        i, _, s = partition_bytes(chain)
        return (float(i), float(s), sum(r.params for r in chain) * self.bytes_per_param,
                sum(self.fixed_bytes[start:start + count]))

    def stage_parts(self, balance: Sequence[int]) -> list[tuple[float, float, float, float]]:
        """(I, S, parameter state, fixed) of each stage of ``balance``.

        Raises:
            ValueError: a balance that does not cover the layers.
        """
        if sum(balance) != len(self.records) or min(balance) < 1:
            raise ValueError(f"balance {list(balance)} must be positive and sum to {len(self.records)} layers")
        out, start = [], 0
        for count in balance:
            out.append(self._chain(start, count))
            start += count
        return out

    def stage_peaks(self, plan: Schedule, balance: Sequence[int], microbatches: int, batch: int,
                    checkpoint: str) -> list[float]:
        """Each device's (rank's) peak bytes (parameter state + activations) for the plan.

        With v virtual stages per rank (``balance`` has K·v entries, stage s on rank ``s % K``) a rank's
        figure is the sum of its stages' peaks, as the engine reports them (one ``StageRuntime`` per
        stage): an upper bound of the rank's concurrent peak.

        Raises:
            ValueError: a bad balance or checkpoint mode.
        """
        parts = self.stage_parts(balance)
        ranks, stages = len(plan), len(balance)
        lists = plan if stages == ranks else [[a for a in plan[s % ranks] if a.stage == s] for s in range(stages)]
        acts = activation_peaks(lists, [p[0] for p in parts], [p[1] for p in parts], batch / microbatches,
                                checkpoint, [p[3] for p in parts])
        per_stage = [a + p[2] for a, p in zip(acts, parts)]
        return [sum(per_stage[s] for s in range(k, stages, ranks)) for k in range(ranks)]

    def layer_weights(self, samples: float) -> list[float]:
        """A per-layer memory weight for ``balance_by_cost``: parameter state plus the layer's saved
        bytes of one micro-batch of ``samples``."""
        return [r.params * self.bytes_per_param + (sum(r.inputs) + r.saved_other) * samples for r in self.records]

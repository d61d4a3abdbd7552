"""Per-action costs for the simulator: fixed + per-sample, fitted per layer, plus hand-over per boundary.

Scaling one micro-batch size's per-layer time linearly with the micro-batch
misses the fixed cost of every call (dispatch, kernel launch, Python), which
dominates small micro-batches on CPU. Here each layer's forward (with and without
autograd) and backward is ``fixed + per_sample x n``, least-squares fitted from
times measured at two or more micro-batch sizes; a stage's action is the sum over
its layers plus ``action_overhead`` (the engine's own bookkeeping per action),
and every boundary crossing adds ``handover``. Once fitted, the model predicts any
(balance, M) without timing again: two predictions of the same setting are equal.

    model = CostModel.fit({8: times_at_8, 32: times_at_32}, action_overhead=2e-4, handover=1e-4)
    model.predict([4, 4], chunks=4, batch=32).step_time
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpipe_lab.pipeline.gpipe import checkpointed_microbatches
from gpipe_lab.pipeline.schedule import get_schedule
from gpipe_lab.planner.simulator import Prediction, StageCosts, predict_step

#: The per-layer times a cost model is fitted from (``experiments.throughput_lib.layer_times``'s keys).
KINDS = ("forward_grad", "forward_nograd", "backward")


@dataclass(frozen=True)
class LinearCost:
    """``fixed + per_sample x n`` seconds for ``n`` samples (never negative)."""

    fixed: float
    per_sample: float

    def at(self, samples: float) -> float:
        """Seconds on ``samples`` samples."""
        return max(0.0, self.fixed + self.per_sample * samples)


def fit_linear(sizes: Sequence[float], seconds: Sequence[float]) -> LinearCost:
    """Least-squares ``fixed + per_sample x n`` through (size, seconds) points, both terms kept >= 0.

    Raises:
        ValueError: lists of different lengths, or fewer than two distinct sizes.
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} sizes but {len(seconds)} times")
    if len(set(sizes)) < 2:
        raise ValueError(f"a fixed + per-sample fit needs >= 2 distinct micro-batch sizes, got {sorted(set(sizes))}")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    fixed = my - slope * mx
    if slope < 0:  # noise on a layer too cheap to grow with n: a constant
        return LinearCost(my, 0.0)
    if fixed < 0:  # noise on a purely proportional layer: through the origin
        return LinearCost(0.0, sum(x * y for x, y in zip(sizes, seconds)) / sum(x * x for x in sizes))
    return LinearCost(fixed, slope)


@dataclass(frozen=True)
class CostModel:
    """Per-layer linear costs of each kind in ``KINDS``, plus engine overhead per action and hand-over per hop.

    Raises:
        ValueError: a missing kind, kinds with different layer counts, or a negative overhead / hand-over.
    """

    layers: Mapping[str, Sequence[LinearCost]]
    action_overhead: float = 0.0
    handover: float = 0.0

    def __post_init__(self) -> None:
        missing = [k for k in KINDS if k not in self.layers]
        if missing:
            raise ValueError(f"cost model lacks {missing}; needs {list(KINDS)}")
        counts = {k: len(self.layers[k]) for k in KINDS}
        if len(set(counts.values())) != 1:
            raise ValueError(f"kinds cover different layer counts: {counts}")
        if self.action_overhead < 0 or self.handover < 0:
            raise ValueError(f"action_overhead and handover must be >= 0, got {self.action_overhead}, "
                             f"{self.handover}")

    @property
    def num_layers(self) -> int:
        return len(self.layers[KINDS[0]])

    @classmethod
    def fit(cls, times_by_size: Mapping[int, Mapping[str, Sequence[float]]], action_overhead: float = 0.0,
            handover: float = 0.0) -> CostModel:
        """Fit every layer's kinds from ``{micro-batch size: {kind: per-layer seconds}}``.

        Raises:
            ValueError: fewer than two sizes, a size missing a kind, or different layer counts.
        """
        sizes = sorted(times_by_size)
        if len(sizes) < 2:
            raise ValueError(f"need per-layer times at >= 2 micro-batch sizes to fit fixed + per-sample, got {sizes}")
        layers = {}
        for kind in KINDS:
            if any(kind not in times_by_size[s] for s in sizes):
                raise ValueError(f"per-layer {kind!r} times missing at some of the sizes {sizes}")
            columns = list(zip(*(times_by_size[s][kind] for s in sizes), strict=True))
            layers[kind] = [fit_linear(sizes, list(col)) for col in columns]
        return cls(layers, action_overhead, handover)

    def stage_seconds(self, kind: str, balance: Sequence[int], samples: float) -> list[float]:
        """Seconds of one ``kind`` action of each stage on ``samples`` samples (engine overhead included).

        Raises:
            ValueError: an unknown kind, or a balance that does not cover the layers.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; allowed: {list(KINDS)}")
        if sum(balance) != self.num_layers:
            raise ValueError(f"balance {list(balance)} covers {sum(balance)} layers, the model has {self.num_layers}")
        out, start = [], 0
        for count in balance:
            out.append(self.action_overhead + sum(c.at(samples) for c in self.layers[kind][start:start + count]))
            start += count
        return out

    def durations(self, balance: Sequence[int], chunks: int, batch: int, checkpoint: str = "except_last",
                  ) -> dict[tuple[int, str, int], float]:
        """Seconds of every GPipe action ``(stage, kind, micro-batch)``: a checkpointed micro-batch's
        forward runs without autograd and is replayed (R) with it; the others keep their graph.

        Raises:
            ValueError: a bad balance or checkpoint mode.
        """
        samples = batch / chunks
        replayed = checkpointed_microbatches(checkpoint, chunks)
        grad, nograd, back = (self.stage_seconds(k, balance, samples) for k in KINDS)
        out = {}
        for k in range(len(balance)):
            for i in range(chunks):
                out[(k, "F", i)] = nograd[k] if i in replayed else grad[k]
                out[(k, "B", i)] = back[k]
                if i in replayed:
                    out[(k, "R", i)] = grad[k]
        return out

    def predict(self, balance: Sequence[int], chunks: int, batch: int, schedule: str = "gpipe",
                checkpoint: str = "except_last") -> Prediction:
        """The simulator's step for ``balance`` with ``chunks`` micro-batches of a ``batch``-sample mini-batch.

        Raises:
            ValueError: a bad balance, schedule or checkpoint mode.
        """
        k = len(balance)
        samples = batch / chunks
        grad, back = self.stage_seconds("forward_grad", balance, samples), self.stage_seconds("backward", balance,
                                                                                             samples)
        costs = StageCosts(grad, back, [0.0] * k, grad, [self.handover] * max(k - 1, 0))
        return predict_step(get_schedule(schedule, k, chunks), costs, checkpointed_microbatches(checkpoint, chunks),
                            self.durations(balance, chunks, batch, checkpoint))

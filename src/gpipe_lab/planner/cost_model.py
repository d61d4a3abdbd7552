"""Per-action costs for the simulator: fixed + per-sample, fitted per layer, plus hand-over per boundary.

Scaling one micro-batch size's per-layer time linearly with the micro-batch
misses the fixed cost of every call (dispatch, kernel launch, Python), which
dominates small micro-batches on CPU. Here each layer's forward (with and without
autograd) and backward is ``fixed + per_sample x n``, fitted from times measured at
two or more micro-batch sizes (on each interval between neighbouring sizes, so every
measured size is reproduced: ``PiecewiseCost``); a stage's action is the sum over
its layers plus ``action_overhead`` (the engine's own bookkeeping per action),
and every boundary crossing adds ``handover``. A replayed forward may have its own
``recompute`` times (a stage replays without the random-replay hop when the forward
drew nothing); without them it costs ``forward_grad``. Given ``contended`` fits too
(the same layers timed while a second stage runs), each action of a multi-stage step
costs between the two by how much it overlaps other stages' work
(``planner.contention``). Once fitted, the model predicts any (balance, M) without
timing again: two predictions of the same setting are equal.

    model = CostModel.fit({8: times_at_8, 32: times_at_32}, action_overhead=2e-4, handover=1e-4)
    model.predict([4, 4], chunks=4, batch=32).step_time
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpipe_lab.pipeline import PipelineOptions, checkpointed_microbatches
from gpipe_lab.pipeline.schedules import Schedule, get_schedule
from gpipe_lab.planner.contention import predict_contended
from gpipe_lab.planner.simulator import Prediction, StageCosts, predict_step

#: The per-layer times a cost model is fitted from (``planner.layer_timing.layer_times``'s keys).
KINDS = ("forward_grad", "forward_nograd", "backward")
#: An optional kind: a checkpointed micro-batch's replayed forward (``forward_grad`` when absent).
RECOMPUTE = "recompute"
#: Schedules whose backward is split into B and W (``CostModel.lower_bound`` lets B + W cost their least).
SPLIT_BACKWARD = ("gpipe-bw", "zb-h1", "zb-h2")
#: A split backward's B and W per stage as multiples of the full backward (``CostModel.predict``'s ``split``).
Split = Sequence[tuple[float, float]]


@dataclass(frozen=True)
class LinearCost:
    """``fixed + per_sample x n`` seconds for ``n`` samples (never negative)."""

    fixed: float
    per_sample: float

    def at(self, samples: float) -> float:
        """Seconds on ``samples`` samples."""
        return max(0.0, self.fixed + self.per_sample * samples)


@dataclass(frozen=True)
class PiecewiseCost:
    """Seconds for ``n`` samples, ``fixed + per_sample x n`` on each interval between neighbouring
    measured sizes (the end intervals extended), so that every measured size is reproduced.

    A single line through three or more sizes cannot follow a layer whose per-sample cost
    changes with the micro-batch (caches, kernel choice); the grids this model predicts are
    made of the sizes it was timed at.
    """

    sizes: tuple[float, ...]
    pieces: tuple[LinearCost, ...]

    def at(self, samples: float) -> float:
        """Seconds on ``samples`` samples."""
        return self.pieces[bisect.bisect_left(self.sizes, samples, 1, len(self.sizes) - 1) - 1].at(samples)


#: Per-layer costs of each kind.
Layers = Mapping[str, Sequence[LinearCost | PiecewiseCost]]


def fit_piecewise(sizes: Sequence[float], seconds: Sequence[float]) -> PiecewiseCost:
    """The line through each pair of neighbouring (size, seconds) points (repeated sizes averaged first).

    Raises:
        ValueError: lists of different lengths, or fewer than two distinct sizes.
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} sizes but {len(seconds)} times")
    by_size: dict[float, list[float]] = {}
    for x, y in zip(sizes, seconds):
        by_size.setdefault(x, []).append(y)
    xs = sorted(by_size)
    if len(xs) < 2:
        raise ValueError(f"a fixed + per-sample fit needs >= 2 distinct micro-batch sizes, got {xs}")
    ys = [sum(by_size[x]) / len(by_size[x]) for x in xs]
    slopes = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
    # each line goes through its two points; its terms may be negative there (``at`` never is)
    return PiecewiseCost(tuple(xs), tuple(LinearCost(ys[i] - m * xs[i], m) for i, m in enumerate(slopes)))


@dataclass(frozen=True)
class CostModel:
    """Per-layer linear costs of each kind in ``KINDS`` (and optionally ``RECOMPUTE``), plus engine
    overhead per action and hand-over per hop; ``contended`` holds the same kinds timed beside a
    second busy stage (None: stages do not slow each other).

    Raises:
        ValueError: a missing kind, kinds with different layer counts (in either table), or a negative
            overhead / hand-over.
    """

    layers: Layers
    action_overhead: float = 0.0
    handover: float = 0.0
    contended: Layers | None = None

    def __post_init__(self) -> None:
        for name, table in (("layers", self.layers), ("contended", self.contended)):
            if table is None:
                continue
            missing = [k for k in KINDS if k not in table]
            if missing:
                raise ValueError(f"cost model lacks {missing} in {name}; needs {list(KINDS)}")
            counts = {k: len(v) for k, v in table.items()}
            if len(set(counts.values())) != 1 or len(table[KINDS[0]]) != len(self.layers[KINDS[0]]):
                raise ValueError(f"kinds cover different layer counts: {counts} ({name})")
        if self.contended is not None and (RECOMPUTE in self.layers) != (RECOMPUTE in self.contended):
            raise ValueError(f"{RECOMPUTE!r} is in one of layers / contended but not the other")
        if self.action_overhead < 0 or self.handover < 0:
            raise ValueError(f"action_overhead and handover must be >= 0, got {self.action_overhead}, "
                             f"{self.handover}")

    @property
    def num_layers(self) -> int:
        return len(self.layers[KINDS[0]])

    @classmethod
    def fit(cls, times_by_size: Mapping[int, Mapping[str, Sequence[float]]], action_overhead: float = 0.0,
            handover: float = 0.0, contended_by_size: Mapping[int, Mapping[str, Sequence[float]]] | None = None,
            ) -> CostModel:
        """Fit every layer's kinds from ``{micro-batch size: {kind: per-layer seconds}}`` (and the
        contended table from ``contended_by_size``, the same shape), piecewise (``fit_piecewise``).

        Raises:
            ValueError: fewer than two sizes, a size missing a kind, or different layer counts.
        """
        contended = None if contended_by_size is None else _fit_table(contended_by_size)
        return cls(_fit_table(times_by_size), action_overhead, handover, contended)

    def stage_seconds(self, kind: str, balance: Sequence[int], samples: float, contended: bool = False,
                      ) -> list[float]:
        """Seconds of one ``kind`` action of each stage on ``samples`` samples (engine overhead included),
        alone or (``contended``) beside another busy stage.

        Raises:
            ValueError: an unknown kind, or a balance that does not cover the layers.
        """
        table = self.contended if contended and self.contended is not None else self.layers
        if kind == RECOMPUTE and kind not in table:
            kind = "forward_grad"
        if kind not in KINDS and kind != RECOMPUTE:
            raise ValueError(f"unknown kind {kind!r}; allowed: {[*KINDS, RECOMPUTE]}")
        if sum(balance) != self.num_layers:
            raise ValueError(f"balance {list(balance)} covers {sum(balance)} layers, the model has {self.num_layers}")
        out, start = [], 0
        for count in balance:
            out.append(self.action_overhead + sum(c.at(samples) for c in table[kind][start:start + count]))
            start += count
        return out

    def durations(self, balance: Sequence[int], chunks: int, batch: int, checkpoint: str = "except_last",
                  contended: bool = False) -> dict[tuple[int, str, int], float]:
        """Seconds of every GPipe action ``(stage, kind, micro-batch)``: a checkpointed micro-batch's
        forward runs without autograd and is replayed (R) with it; the others keep their graph.
        ``contended``: each action's cost beside another busy stage.

        Raises:
            ValueError: a bad balance or checkpoint mode.
        """
        samples = batch / chunks
        replayed = checkpointed_microbatches(checkpoint, chunks)
        grad, nograd, back, again = (self.stage_seconds(k, balance, samples, contended)
                                     for k in (*KINDS, RECOMPUTE))
        out = {}
        for k in range(len(balance)):
            for i in range(chunks):
                out[(k, "F", i)] = nograd[k] if i in replayed else grad[k]
                out[(k, "B", i)] = back[k]
                if i in replayed:
                    out[(k, "R", i)] = again[k]
        return out

    def predict(self, balance: Sequence[int], chunks: int, batch: int, schedule: str = "gpipe",
                checkpoint: str = "except_last", split: Split | None = None,
                virtual_stages: int = 1) -> Prediction:
        """The simulator's step for ``balance`` with ``chunks`` micro-batches of a ``batch``-sample mini-batch.

        With ``virtual_stages`` v > 1, ``balance`` has K·v entries (placed as the schedule places them) and the
        timeline is by rank, as the executor records it.

        ``split``: for schedules with split backward (a ``W`` action), per stage (the last entry for
        the stages after it), the times of its ``B`` and of its ``W`` as multiples of the measured full
        backward (e.g. ``[(0.5, 0.5)]``; more than 1 in total when splitting costs extra work); ``None``
        counts the whole backward in ``B`` and ``W`` as free.

        Raises:
            ValueError: a bad balance, schedule or checkpoint mode, or a negative ``split`` factor.
        """
        if split is not None and (not split or min(min(f) for f in split) < 0):
            raise ValueError(f"split must be a non-empty list of (B, W) factors >= 0, got {split}")
        stages = len(balance)
        if virtual_stages < 1 or stages % virtual_stages:
            raise ValueError(f"balance {list(balance)} has {stages} stages, not a multiple of virtual_stages="
                             f"{virtual_stages}")
        k = stages // virtual_stages
        samples = batch / chunks
        grad, back = self.stage_seconds("forward_grad", balance, samples), self.stage_seconds("backward", balance,
                                                                                             samples)
        costs = StageCosts(grad, back, [0.0] * stages, grad, [self.handover] * max(stages - 1, 0))
        plan = get_schedule(schedule, k, chunks, virtual_stages)
        replayed = checkpointed_microbatches(checkpoint, chunks)
        alone = _split(self.durations(balance, chunks, batch, checkpoint), plan, split)
        if self.contended is None or k < 2:
            return predict_step(plan, costs, replayed, alone)
        contended = _split(self.durations(balance, chunks, batch, checkpoint, True), plan, split)
        return predict_contended(plan, costs, alone, contended, replayed)

    def predict_options(self, options: PipelineOptions, batch: int, split: Split | None = None) -> Prediction:
        """``predict`` for the plan ``options`` hold (balance, chunks, schedule, checkpoint, virtual stages).

        Raises:
            ValueError: as ``predict``; no ``balance`` in ``options``.
        """
        if options.balance is None:
            raise ValueError("balance: a plan's options name the balance, got None")
        return self.predict(options.balance, options.chunks, batch, options.schedule, options.checkpoint, split,
                            options.virtual_stages)

    def lower_bound(self, options: PipelineOptions, batch: int, split: Split | None = None) -> float:
        """A lower bound of ``predict_options``' step, without simulating: the busiest device's actions
        end to end, and one micro-batch's forward and backward through every stage (this model's own
        costs; a split backward's B + W at the least they may cost).

        Raises:
            ValueError: as ``predict_options``.
        """
        if options.balance is None:
            raise ValueError("balance: a plan's options name the balance, got None")
        m, samples = options.chunks, batch / options.chunks
        grad, nograd, back, again = (self.stage_seconds(kind, options.balance, samples)
                                     for kind in (*KINDS, RECOMPUTE))
        replayed = len(checkpointed_microbatches(options.checkpoint, m))
        here = split if split and options.schedule in SPLIT_BACKWARD else None
        both = min(1.0, min(b + w for b, w in here)) if here else 1.0  # B + W of a micro-batch
        only_b = min(1.0, min(b for b, _ in here)) if here else 1.0  # B alone: the backward's path
        stage = [(m - replayed) * g + replayed * (n + a) + m * b * both
                 for g, n, b, a in zip(grad, nograd, back, again)]
        k = len(stage) // options.virtual_stages
        busiest = max(sum(stage[s] for s in range(d, len(stage), k)) for d in range(k))
        path = sum(min(g, n) for g, n in zip(grad, nograd)) + only_b * sum(back)
        return max(busiest, path)


def _split(durations: dict[tuple[int, str, int], float], plan: Schedule,
           split: Split | None) -> dict[tuple[int, str, int], float]:
    """``durations`` with each split backward's B and W as ``split``'s multiples of the full backward."""
    if split is None:
        return durations
    out = dict(durations)
    for actions in plan:
        for a in actions:
            if a.kind == "W":
                k = a.stage
                full, (b, w) = durations[(k, "B", a.microbatch)], split[min(k, len(split) - 1)]
                out[(k, "B", a.microbatch)] = full * b
                out[(k, "W", a.microbatch)] = full * w
    return out


def _fit_table(times_by_size: Mapping[int, Mapping[str, Sequence[float]]]) -> dict[str, list[PiecewiseCost]]:
    sizes = sorted(times_by_size)
    if len(sizes) < 2:
        raise ValueError(f"need per-layer times at >= 2 micro-batch sizes to fit fixed + per-sample, got {sizes}")
    kinds = [*KINDS, *([RECOMPUTE] if all(RECOMPUTE in times_by_size[s] for s in sizes) else [])]
    layers = {}
    for kind in kinds:
        if any(kind not in times_by_size[s] for s in sizes):
            raise ValueError(f"per-layer {kind!r} times missing at some of the sizes {sizes}")
        columns = list(zip(*(times_by_size[s][kind] for s in sizes), strict=True))
        layers[kind] = [fit_piecewise(sizes, list(col)) for col in columns]
    return layers

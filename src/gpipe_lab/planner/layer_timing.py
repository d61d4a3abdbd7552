"""Per-layer times for the simulator, taken the way a CPU stage runs its layers: alone or beside a second stage.

A stage runs each forward inside its micro-batch's random-replay context (a
``TorchDispatchMode`` that routes every random op to the micro-batch's
generator), with one intra-op thread; it replays a checkpointed forward without
that hop when the forward drew nothing. ``layer_times`` times every layer that
way: ``forward_grad`` and ``forward_nograd`` inside the context, ``recompute``
(with autograd, inside the context only if the layer drew) and ``backward``.
Each figure is one slice of a single chained pass (a layer's input is the
previous layer's output, its backward needs that pass's graph), so the clock is
read around each call.

Stages of one process share the interpreter lock and the memory bandwidth.
``contended=True`` runs the same timed pass on two threads at once, each on its
own copy of the network, kept in step by a barrier at every forward and backward
phase (a GPipe step pairs forwards with forwards and backwards with backwards);
the figures are the mean of the two threads'.

``engine_overhead`` and ``hop_seconds`` give the two costs per-layer times do not contain: the
engine's own work per action, and the hand-over between neighbouring stages.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import nullcontext

import torch

from gpipe_lab.pipeline.measuring.step_timeline import Timeline
from gpipe_lab.pipeline.stage.context import microbatch_context
from gpipe_lab.planner.workload import WorkloadSpec, tiny_linear

#: Seconds a timing thread waits for its twin at a phase boundary before giving up.
BARRIER_TIMEOUT_S = 600.0
KINDS = ("forward_grad", "forward_nograd", "recompute", "backward")


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def layer_times(work: WorkloadSpec, micro_batch: int, repeat: int = 3, contended: bool = False,
                ) -> dict[str, list[float]]:
    """Per-layer median seconds of each kind in ``KINDS`` on one ``micro_batch``-sample micro-batch,
    one intra-op thread, alone or (``contended``) beside a second thread running the same pass.

    Raises:
        ValueError: ``repeat`` < 1 or ``micro_batch`` < 1.
        RuntimeError: a timing thread failed (its error is chained) or did not reach a phase boundary
            within ``BARRIER_TIMEOUT_S``.
    """
    if repeat < 1 or micro_batch < 1:
        raise ValueError(f"repeat and micro_batch must be >= 1, got repeat={repeat}, micro_batch={micro_batch}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not contended:
            return _timed_pass(work, micro_batch, repeat, None)
        barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S)
        results: list[dict[str, list[float]] | BaseException | None] = [None, None]

        def run(i: int) -> None:
            try:
                results[i] = _timed_pass(work, micro_batch, repeat, barrier)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                results[i] = exc
                barrier.abort()

        twins = [threading.Thread(target=run, args=(i,), name=f"layer-timing-{i}", daemon=True) for i in range(2)]
        for t in twins:
            t.start()
        for t in twins:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise RuntimeError(f"contended layer timing failed: {r}") from r
        a, b = results
        assert isinstance(a, dict) and isinstance(b, dict)
        return {k: [(x + y) / 2 for x, y in zip(a[k], b[k])] for k in a}
    finally:
        torch.set_num_threads(threads)


def _timed_pass(work: WorkloadSpec, micro_batch: int, repeat: int, barrier: threading.Barrier | None,
                ) -> dict[str, list[float]]:
    built = work.build()
    model, x, y, loss_fn = built.module, built.inputs, built.targets, built.loss_fn
    x = tuple(t[:micro_batch] for t in x) if isinstance(x, tuple) else x[:micro_batch]
    y = y[:micro_batch]
    n = len(model)
    samples: dict[str, list[list[float]]] = {k: [[] for _ in range(n)] for k in KINDS}
    generator = torch.Generator().manual_seed(0)
    for _ in range(repeat + 1):  # the first pass warms up
        if barrier is not None:
            barrier.wait()
        value, saved = x, []
        for i, layer in enumerate(model):
            ins = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _as_tuple(value))
            arg = ins if isinstance(value, tuple) else ins[0]
            start = time.perf_counter()
            with torch.no_grad(), microbatch_context(generator):
                layer(arg)
            samples["forward_nograd"][i].append(time.perf_counter() - start)
            start = time.perf_counter()
            with microbatch_context(generator) as mode:
                out = layer(arg)
                if i == n - 1:
                    out = loss_fn(out, y)
            samples["forward_grad"][i].append(time.perf_counter() - start)
            drew = mode is not None and mode.draws > 0
            start = time.perf_counter()
            with microbatch_context(generator) if drew else nullcontext():
                again = layer(arg)
                if i == n - 1:
                    again = loss_fn(again, y)
            samples["recompute"][i].append(time.perf_counter() - start)
            del again
            saved.append((ins, out))
            value = out
        if barrier is not None:
            barrier.wait()
        grads: tuple = (None,)
        for i in reversed(range(n)):
            ins, out = saved[i]
            pairs = [(o, g) for o, g in zip(_as_tuple(out), grads) if o.requires_grad]
            start = time.perf_counter()
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            samples["backward"][i].append(time.perf_counter() - start)
            grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in ins)
        model.zero_grad(set_to_none=True)
    return {k: [statistics.median(s[1:]) for s in v] for k, v in samples.items()}


def engine_costs(steps: int = 3) -> tuple[float, float]:
    """(per-action overhead, hand-over per hop) in seconds, from ``GPipe`` on a near-empty workload
    (4 x Linear(4, 4), K=2, M=8, one thread per stage): the median action, and ``hop_seconds`` of
    the last step, the two costs per-layer times do not contain."""
    from gpipe_lab.pipeline import GPipe

    work = tiny_linear(16, partitions=2)
    pipe = GPipe(work.module, balance=work.balance, chunks=8, threads_per_stage=1, seed=0)
    for _ in range(steps + 1):
        pipe.train_step(work.inputs, work.targets, work.loss_fn)
    assert pipe.timeline is not None
    durations = [e.duration for e in pipe.timeline.events if e.kind != "wait"]
    return statistics.median(durations), hop_seconds(pipe.timeline)


def engine_overhead(steps: int = 3) -> float:
    """Median seconds of one action of ``GPipe`` on a near-empty workload (``engine_costs``'s first):
    the engine's own per-action cost, which per-layer times do not contain."""
    return engine_costs(steps)[0]


def hop_seconds(timeline: Timeline) -> float:
    """Median hand-over delay between stages measured in a real step (0 for one stage)."""
    from gpipe_lab.planner.simulator import costs_from_timeline

    if timeline.num_stages < 2:
        return 0.0
    transfer = costs_from_timeline(timeline).transfer or [0.0]
    return float(statistics.median(transfer))


def split_backward(work: WorkloadSpec, steps: int = 2) -> tuple[tuple[float, float], tuple[float, float]]:
    """``(B, W)`` of a split backward as multiples of the full backward, for a first stage and for a
    later one: the engine at K=2 (layers halved), M=1, one thread per stage, the median step's
    ``B`` and ``W`` of each stage under ``zb-h1`` over its ``B`` under ``gpipe``. A first stage whose
    input needs no gradient (tokens) has nothing for B to do; a layer without a cheap weight-only
    backward makes ``W`` repeat work.

    Raises:
        ValueError: a model of fewer than two layers.
    """
    from gpipe_lab.pipeline import GPipe

    def seconds(schedule: str) -> list[dict[str, float]]:
        built = work.build(1)
        n = len(built.module)
        if n < 2:
            raise ValueError(f"split_backward needs >= 2 layers, {work.preset} has {n}")
        pipe = GPipe(built.module, balance=[n // 2, n - n // 2], chunks=1, checkpoint="never", schedule=schedule,
                     threads_per_stage=1, seed=0)
        sums: list[list[dict[str, float]]] = []
        for _ in range(steps + 1):  # the first warms up
            pipe.train_step(built.inputs, built.targets, built.loss_fn)
            built.module.zero_grad(set_to_none=True)
            assert pipe.timeline is not None
            events = pipe.timeline.events
            sums.append([{kind: sum(e.duration for e in events if e.kind == kind and e.stage == k) for kind in "BW"}
                         for k in range(2)])
        return [{kind: statistics.median(s[k][kind] for s in sums[1:]) for kind in "BW"} for k in range(2)]

    full, split = seconds("gpipe"), seconds("zb-h1")
    first, later = ((split[k]["B"] / full[k]["B"], split[k]["W"] / full[k]["B"]) if full[k]["B"] > 0 else (0.5, 0.5)
                    for k in range(2))
    return first, later

"""The yardstick every user compares with: plain PyTorch stepping the same M micro-batches.

Plain is the unpipelined module taking forward + loss + backward of each of the M
micro-batches in turn, gradients accumulating (each loss weighted by its share of the
batch, as the engine weights it), on one intra-op thread. Against it, in the same
alternated rounds, ``GPipe.train_step`` with ``checkpoint="never"`` and one thread per stage:

- K=1: the engine's pure overhead (the same work, the same thread count; 1.0 is free);
- K=2: the pipeline's gain (plain / engine; above 1 the pipeline pays);

- K=2 balanced by measured time (``pipeline.cost=time``: ``balance_by_time`` on one micro-batch, one
  thread) where FLOPs miss what small layers cost;

each with ``random_replay`` as users get it (``"auto"``, the default) and off; their ratio less one
is random replay's cost. Every ratio is the median of the per-round ratios of its two contenders
(``paired_ratio``: a slow moment of the machine hits both calls of a round alike) (the MLP and AmoebaNet draw nothing). ``replay_row`` measures that cost
where something is drawn: the Transformer with ``dropout=0.1``. Every contender owns a module built
from the same seed, so each trains the same weights on the same batch. The workloads are the
mode's (``bench_common.SIZES``), the MLP at ``yardstick_mlp_batch`` (512 rows: the 1024 of the
other MLP rows would take most of ``--quick``'s time here).

    python -m benchmarks.bench_yardstick [--smoke] [--chunks 4]   # prints the table
"""

from __future__ import annotations

if not __package__:  # started as a file (``python benchmarks/bench_yardstick.py``): rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import dataclasses
from collections.abc import Callable, Sequence

import torch

from benchmarks.bench_ceiling import ceiling_functions, ceiling_summary, split_batch
from benchmarks.bench_common import SIZES, Sizes, make_workload, prepare_process, sync
from gpipe_lab.bench import md_table
from gpipe_lab.pipeline import GPipe, balance_by_time
from gpipe_lab.pipeline.measuring.call_timing import Timing, paired_ratio, time_rounds
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.planner.workload import Workload

CHUNKS = 4
#: alternated rounds per contender (at least): each ratio is the median of its per-round ratios
ROUNDS = 5
#: more rounds where a step is short (at --quick): with the default rounds a short step's ratio moved
#: more from one run to the next than the targets' margins; the median of more rounds holds still
WORKLOAD_ROUNDS = {"transformer": 9, "amoebanet": 15}
#: contender -> (K, random_replay)
ENGINES = {"K=1": (1, "auto"), "K=1, no replay": (1, False), "K=2": (2, "auto"), "K=2, no replay": (2, False)}
#: the K=2 contender cut by measured forward+backward time instead of FLOPs (replay at its default)
TIME_BALANCED = "K=2, time balance"
#: the drawing workload of the replay-cost row
DROPOUT = 0.1


def plain_step(work: Workload, chunks: int, device: str) -> Callable[[], None]:
    """Forward + loss + backward of each micro-batch in turn on one thread, gradients accumulating."""
    inputs, targets = split_batch(work.inputs, chunks), split_batch(work.targets, chunks)
    weights = [t.shape[0] / work.batch for t in targets]

    def step() -> None:
        torch.set_num_threads(1)
        for x, y, w in zip(inputs, targets, weights):
            (work.loss_fn(work.module(x), y) * w).backward()
        sync(device)

    return step


def engine(work: Workload, chunks: int, device: str, random_replay: bool | str) -> GPipe:
    """``GPipe`` over ``work``'s balance, ``checkpoint="never"``, one intra-op thread per stage."""
    options = PipelineOptions(balance=list(work.balance), chunks=chunks, checkpoint="never",
                              devices=[device] * len(work.balance), threads_per_stage=1, seed=0,
                              random_replay=random_replay)
    return GPipe(work.module, options=options)


def time_balance(work: Workload, chunks: int) -> list[int]:
    """The K=2 cut ``balance_by_time`` makes on one micro-batch of ``work`` with one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return balance_by_time(work.module, split_batch(work.inputs, chunks)[0], 2)
    finally:
        torch.set_num_threads(threads)


def _engine_steps(name: str, sizes: Sizes, device: str, chunks: int, engines: dict[str, tuple[int, bool | str]],
                  works: dict[str, Workload]) -> dict[str, Callable[[], None]]:
    """A step function per engine contender (``TIME_BALANCED``: K=2 cut by ``time_balance``); each
    contender's workload lands in ``works``."""
    fns: dict[str, Callable[[], None]] = {}
    for label, (k, replay) in engines.items():
        work = make_workload(name, sizes, partitions=k).to(torch.device(device))
        if label == TIME_BALANCED:
            work = dataclasses.replace(work, balance=time_balance(work, chunks))
        pipe = engine(work, chunks, device, replay)
        works[label] = work

        def step(pipe: GPipe = pipe, work: Workload = work) -> None:
            pipe.train_step(work.inputs, work.targets, work.loss_fn)
            sync(device)

        fns[label] = step
    return fns


def _timed(fns: dict[str, Callable[[], None]], works: dict[str, Workload], sizes: Sizes,
           name: str) -> dict[str, Timing]:
    """Each contender's timed calls, in alternated rounds (gradients zeroed between calls)."""
    def zero() -> None:
        for work in works.values():
            work.module.zero_grad(set_to_none=True)

    smoke = sizes.name == "smoke"
    times = time_rounds(fns, _rounds(sizes, name), sizes.warmup if smoke else 1, zero)
    zero()
    return times


def _rounds(sizes: Sizes, name: str = "") -> int:
    """Alternated rounds per contender for workload ``name``."""
    return sizes.repeats if sizes.name == "smoke" else max(WORKLOAD_ROUNDS.get(name, ROUNDS), sizes.repeats)


def measure(name: str, sizes: Sizes, device: str, chunks: int = CHUNKS) -> dict[str, object]:
    """Median seconds per step of plain and of each engine contender, and their ratios, in one run.

    Raises:
        ValueError: an unknown workload name (from ``make_workload``).
    """
    if name == "mlp":
        sizes = dataclasses.replace(sizes, mlp_batch=sizes.yardstick_mlp_batch)
    plain_work = make_workload(name, sizes, partitions=1).to(torch.device(device))
    works = {"plain": plain_work}
    fns: dict[str, Callable[[], None]] = {"plain": plain_step(plain_work, chunks, device)}
    fns.update(_engine_steps(name, sizes, device, chunks, {**ENGINES, TIME_BALANCED: ENGINES["K=2"]}, works))
    ceiling_work = make_workload(name, sizes, partitions=2).to(torch.device(device))
    stage_times: list[list[float]] = [[] for _ in ceiling_work.balance]
    fns.update(ceiling_functions(ceiling_work, chunks, stage_times))
    timed = _timed(fns, works, sizes, name)
    ceiling = ceiling_summary(timed.pop("sequential").times, timed.pop("parallel").times, chunks,
                              [t[-_rounds(sizes, name):] for t in stage_times])
    steps = {label: t.median for label, t in timed.items()}
    ceiling.update(gain=steps["plain"] / ceiling["lower_bound_s"], fraction=ceiling["lower_bound_s"] / steps["K=2"])
    return {"workload": name, "batch": plain_work.batch, "M": chunks, "rounds": _rounds(sizes, name), "step_s": steps,
            "rounds_s": {label: list(t.times) for label, t in timed.items()},
            "overhead": {label: paired_ratio(timed[label], timed["plain"]) for label in ENGINES
                         if label.startswith("K=1")},
            "gain": {label: paired_ratio(timed["plain"], timed[label]) for label in [*ENGINES, TIME_BALANCED]
                     if label.startswith("K=2")},
            "balance": {"K=2": list(works["K=2"].balance), TIME_BALANCED: list(works[TIME_BALANCED].balance)},
            "replay_cost": {f"K={k}": paired_ratio(timed[f"K={k}"], timed[f"K={k}, no replay"]) - 1 for k in (1, 2)},
            "ceiling": ceiling}


def replay_row(sizes: Sizes, device: str, chunks: int = CHUNKS, dropout: float = DROPOUT) -> dict[str, object]:
    """Random replay's cost where something is drawn: the Transformer with ``dropout``, K=2,
    ``random_replay="auto"`` against ``False`` in alternated rounds."""
    sizes = dataclasses.replace(sizes, transformer_dropout=dropout)
    works: dict[str, Workload] = {}
    fns = _engine_steps("transformer", sizes, device, chunks,
                        {"K=2": ENGINES["K=2"], "K=2, no replay": ENGINES["K=2, no replay"]}, works)
    timed = _timed(fns, works, sizes, "transformer")
    return {"workload": "transformer", "dropout": dropout, "M": chunks, "rounds": _rounds(sizes, "transformer"),
            "step_s": {label: t.median for label, t in timed.items()},
            "replay_cost": {"K=2": paired_ratio(timed["K=2"], timed["K=2, no replay"]) - 1}}


def run_yardstick(sizes: Sizes, device: str, models: Sequence[str] | None = None,
                  chunks: int = CHUNKS) -> list[dict[str, object]]:
    """``measure`` for each workload of ``sizes`` (or ``models``), printing a line per workload."""
    rows = []
    for name in models or sizes.models:
        rows.append(measure(name, sizes, device, chunks))
        row = rows[-1]
        print(f"[yardstick] {name}: K=1 / plain {row['overhead']['K=1']:.2f}, "  # type: ignore[index]
              f"plain / K=2 {row['gain']['K=2']:.2f}x", flush=True)  # type: ignore[index]
    return rows


def _cost(row: dict) -> str:
    cost = row.get("replay_cost", {}).get("K=2")
    return "-" if cost is None else f"{cost:+.1%}"


def table(rows: Sequence[dict]) -> str:
    """The rows as a markdown table."""
    return md_table(
        ["workload", "batch", "M", "plain s", "K=1 / plain (overhead)", "same, no replay",
         "plain / K=2 (gain)", "same, no replay", "same, time balance", "replay cost at K=2", "K=2 stages alone s",
         "2-thread scaling", "gain ceiling", "rounds"],
        [[r["workload"], r["batch"], r["M"], f"{r['step_s']['plain']:.4f}", f"{r['overhead']['K=1']:.2f}",
          f"{r['overhead']['K=1, no replay']:.2f}", f"{r['gain']['K=2']:.2f}x",
          f"{r['gain']['K=2, no replay']:.2f}x", _time_cell(r), _cost(r), *_ceiling_cells(r.get("ceiling")),
          r["rounds"]]
         for r in rows])


def _time_cell(row: dict) -> str:
    """The time-balanced K=2 gain and both cuts (FLOPs cut first)."""
    gain, balance = row["gain"].get(TIME_BALANCED), row.get("balance")
    if gain is None or not balance:
        return "-"
    return f"{gain:.2f}x ({balance[TIME_BALANCED]}; FLOPs: {balance['K=2']})"


def _ceiling_cells(ceiling: dict | None) -> list[str]:
    """The K=2 stages' own seconds, their 2-thread scaling and the gain no schedule of them beats."""
    if not ceiling:
        return ["-", "-", "-"]
    return [" / ".join(f"{t:.4f}" for t in ceiling["stage_s"]), f"{ceiling['parallel_scaling']:.2f}",
            f"{ceiling['gain']:.2f}x"]


def replay_line(row: dict) -> str:
    """The replay-cost row in words."""
    steps = row["step_s"]
    return (f"{row['workload']} with dropout {row['dropout']}, K=2, M={row['M']}: {steps['K=2']:.4f} s with "
            f"random_replay at its default, {steps['K=2, no replay']:.4f} s without (medians of {row['rounds']} "
            f"rounds): cost {_cost(row)} (median of the per-round ratios)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a structure check")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help="micro-batches M (default 4)")
    parser.add_argument("--models", default=None, help="comma-separated subset of mlp,transformer,amoebanet")
    args = parser.parse_args(argv)
    prepare_process()
    sizes = SIZES["smoke" if args.smoke else "quick"]
    print(table(run_yardstick(sizes, "cpu", args.models.split(",") if args.models else None, args.chunks)))
    print(replay_line(replay_row(sizes, "cpu", args.chunks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

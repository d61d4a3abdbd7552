"""The ``compile`` row: step time of eager vs compiled stages (``compile=True``), and the compile time.

The AmoebaNet-D(18, 32) and the 24 + 24-layer Transformer analogues of Table 2 (as in
``conf/experiment/paper_table2_*.yaml``) at K=2, M ∈ {4, 32}, one thread per stage. Eager
and compiled pipelines of the same weights are timed in alternating rounds
(``gpipe_lab.pipeline.measuring.call_timing.time_rounds``). The compile time is the wall time of the compiled
pipeline's first two steps (the first forward of each stage runs eagerly to check its
random draws; the second step compiles) less two eager steps.

    python -m benchmarks.bench_compile                 # the row (slow: Inductor on 2 cores)
    python -m benchmarks.bench_compile --quick         # 4-layer analogues, mini-batch 32
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_lab.bench import md_table
from gpipe_lab.models import example_input
from gpipe_lab.models.losses import translation_loss
from gpipe_lab.models.preset_registry import build
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.call_timing import time_rounds
from gpipe_lab.pipeline.options import PipelineOptions

K = 2
NO_REPLAY = PipelineOptions(random_replay=False)


def analogue(name: str, quick: bool) -> tuple[Callable[[], nn.Sequential], Any, Any, Callable]:
    """(model factory, batch, target, loss) of the ``amoebanet`` or ``transformer`` analogue.

    Raises:
        ValueError: another name.
    """
    batch = 32 if quick else 256
    if name == "amoebanet":
        sizes = dict(num_layers=6 if quick else 18, num_filters=32, num_classes=10, image_size=32)
        preset, loss = "amoebanet_d", nn.functional.cross_entropy
    elif name == "transformer":
        sizes = dict(num_layers=4 if quick else 24, d_model=128, ffn_dim=512, num_heads=4)
        preset, loss = "transformer_tiny", translation_loss()
    else:
        raise ValueError(f"analogue must be 'amoebanet' or 'transformer', got {name!r}")

    def factory() -> nn.Sequential:
        torch.manual_seed(0)
        return build(preset, **sizes)

    model = factory()
    x = example_input(model, batch, "cpu")
    if name == "amoebanet":
        return factory, x, torch.randint(0, 10, (batch,)), loss
    with torch.no_grad():
        logits = model(x)
    return factory, x, torch.randint(4, logits.shape[-1], logits.shape[:-1]), loss


def measure(name: str, factory: Callable[[], nn.Sequential], x: Any, y: Any, loss_fn: Callable, m: int,
            repeats: int) -> dict[str, Any]:
    """Eager and compiled step medians of one (model, M), their ratio, and the compile seconds.

    The eager pipeline is timed twice: as users get it (``random_replay=True``: every op of a
    forward goes through the replay hop, which compiled stages do not take) and without the
    hop, so the compiled speed-up over the latter is Inductor's alone."""
    # compiling a stage of the full AmoebaNet analogue on 2 busy cores outlasts the default 300 s
    options = dict(partitions=K, chunks=m, checkpoint="except_last", threads_per_stage=1, seed=0, timeout=3600.0)
    pipes = {"eager": GPipe(factory(), **options), "eager_no_replay": GPipe(factory(), options=NO_REPLAY, **options),
             "compiled": GPipe(factory(), compile=True, **options)}
    steps = {key: (lambda pipe=pipe: pipe.train_step(x, y, loss_fn)) for key, pipe in pipes.items()}
    start = time.perf_counter()
    steps["compiled"]()
    steps["compiled"]()
    first_two = time.perf_counter() - start

    def zero() -> None:
        for pipe in pipes.values():
            pipe.module.zero_grad(set_to_none=True)

    timings = time_rounds(steps, repeats, warmup=1, between=zero)
    e, n, c = (timings[k].median for k in ("eager", "eager_no_replay", "compiled"))
    return {"model": name, "K": K, "M": m, "eager_step_s": e, "eager_no_replay_step_s": n, "compiled_step_s": c,
            "speedup": e / c, "speedup_over_no_replay": n / c, "compile_s": first_two - 2 * e,
            **{key: t.summary() for key, t in timings.items()}}


def run_compile(models: list[str], chunks: list[int], quick: bool, repeats: int) -> list[dict[str, Any]]:
    """One row per (model, M) (see ``measure``), printed as JSON as it is measured."""
    torch.set_num_threads(1)
    rows = []
    for name in models:
        factory, x, y, loss_fn = analogue(name, quick)
        for m in chunks:
            rows.append(measure(name, factory, x, y, loss_fn, m, repeats))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    return md_table(["model", "K", "M", "eager step (s)", "eager, no replay (s)", "compiled step (s)", "speed-up",
                     "speed-up over no replay", "compile (s)"],
                    [[r["model"], r["K"], r["M"], f"{r['eager_step_s']:.3f}", f"{r['eager_no_replay_step_s']:.3f}",
                      f"{r['compiled_step_s']:.3f}", f"{r['speedup']:.2f}×", f"{r['speedup_over_no_replay']:.2f}×",
                      f"{r['compile_s']:.0f}"] for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4-layer analogues at mini-batch 32")
    parser.add_argument("--models", nargs="+", default=["amoebanet", "transformer"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[4, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = run_compile(args.models, args.chunks, args.quick, args.repeats)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""``gpipe-plan``: memory of a pipelined model per partition, and the largest model that fits.

    gpipe-plan memory --model amoebanet_d --num-layers 18 --num-filters 416 -K 1 --memory-gib 8 \\
        --batch 128 --microbatches 128
    gpipe-plan search --model transformer_l -K 8 --memory-gib 16 --batch 32 --microbatches 32 --seq-len 1024
    gpipe-plan search --model amoebanet_d --num-layers 18 -K 2 --memory-gib 8 --batch 128 --microbatches 128
    gpipe-plan auto --model transformer_tiny --batch 32 --memory 64MiB --devices 2
    gpipe-plan auto --model amoebanet_d_tiny --batch 64 --memory 8MiB --set num_filters=8 --json

``memory`` and ``search``: memory is measured on the meta device (see ``gpipe_lab.planner.capacity``);
nothing is allocated, so the paper's 83.9B-parameter Transformer plans in seconds
(``--model transformer_l --num-layers 1663 -K 128``; the ``transformer_l`` preset alone is
Table 1's 3-layer member). Every table first restates what it assumes (batch, M, sequence or
image size, re-materialization, bytes per parameter and per activation).

``auto``: the fastest plan (K, M, balance, schedule, checkpoint) that fits a memory budget
(``planner.search``). The model's per-layer times and bytes are measured once and cached
(``planner.profile_cache``); the search takes seconds; the ``--trials`` fastest predicted plans
then run a few steps each and the fastest measured is chosen (``planner.trials``). Exit status 2,
with one line, when no plan fits: the line names the smallest memory that would fit and the plan
it would use.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpipe_lab.planner.capacity import (
    RMSPROP_BYTES_PER_PARAM,
    GiB,
    Plan,
    best_plan,
    layer_records,
    max_amoebanet_filters,
    max_transformer_layers,
)
from gpipe_lab.planner.memory import parse_memory
from gpipe_lab.planner.plan_types import (
    BYTES_PER_PARAM,
    CHECKPOINTS,
    DEFAULT_TRIALS,
    MAX_MICROBATCHES,
    NoPlanFits,
)
from gpipe_lab.planner.search import plan_model

__all__ = ["main", "build_parser", "plan_to_dict"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gpipe-plan`` (subcommands ``memory``, ``search`` and ``auto``)."""
    parser = argparse.ArgumentParser(prog="gpipe-plan", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("memory", "per-partition memory of one model"),
                           ("search", "largest model that fits (layers, or filters D for AmoebaNet)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", default="amoebanet_d", help="preset of gpipe_lab.models.build")
        p.add_argument("--num-layers", type=int, default=None)
        p.add_argument("--num-filters", type=int, default=None, help="AmoebaNet D")
        p.add_argument("--image-size", type=int, default=None, help="AmoebaNet input size")
        p.add_argument("--seq-len", type=int, default=None, help="Transformer sequence length")
        p.add_argument("-K", "--partitions", type=int, default=1)
        p.add_argument("--memory-gib", type=float, default=8.0, help="memory per accelerator (GiB)")
        p.add_argument("--batch", type=int, default=128, help="mini-batch N")
        p.add_argument("--microbatches", type=int, default=None, help="M (default: N, one sample each)")
        p.add_argument("--no-remat", action="store_true", help="keep all activations (Naive / 'never')")
        p.add_argument("--bytes-per-param", type=float, default=RMSPROP_BYTES_PER_PARAM,
                       help="weights + gradients + optimizer slots (RMSProp: 12)")
        p.add_argument("--activation-bytes", type=int, default=4, choices=(2, 4),
                       help="bytes per activation element (4 float32 as measured, 2 bfloat16)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_auto_parser(sub)
    return parser


def _add_auto_parser(sub: Any) -> None:
    """Add the ``auto`` subcommand to ``gpipe-plan``'s subparsers."""
    p = sub.add_parser("auto", help="choose K, M, balance, schedule and checkpoint for a memory budget")
    p.add_argument("--model", default="amoebanet_d_tiny", help="preset of gpipe_lab.models.build")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a size override of the preset (num_layers=8, d_model=64 ...); repeatable")
    p.add_argument("--batch", type=int, default=64, help="mini-batch N")
    p.add_argument("--memory", required=True, help="memory per device: 8GiB, 512MiB, 1.5GB or bytes")
    p.add_argument("--devices", type=int, default=None,
                   help="stages that can run side by side (default: GPUs, else CPU cores)")
    p.add_argument("--schedules", default=None, help="comma-separated schedules allowed (default: all)")
    p.add_argument("--checkpoints", default=",".join(CHECKPOINTS), help="comma-separated checkpoint modes")
    p.add_argument("--max-microbatches", type=int, default=MAX_MICROBATCHES)
    p.add_argument("--bytes-per-param", type=float, default=BYTES_PER_PARAM,
                   help="weights + gradients + optimizer slots per parameter (Adam float32: 16)")
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help="run this many of the fastest predicted plans that fit for a few steps and keep the "
                        "fastest measured (0: choose by the prediction alone)")
    p.add_argument("--cache", default=None, help="profile cache folder (default $GPIPE_LAB_CACHE/plans)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _overrides(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as a dict, each value read as YAML (numbers, lists, strings).

    Raises:
        ValueError: an item without ``=``.
    """
    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set num_layers=8")
        out[key] = yaml.safe_load(value)
    return out


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [s.strip() for s in text.split(",") if s.strip()]


def _run_auto(args: argparse.Namespace) -> int:
    """Plan and print; returns the exit status (0, or 2 with one line on stderr).

    Raises:
        SystemExit: never itself (argparse's errors are raised before this runs).
    """
    try:
        if args.batch < 1 or args.max_microbatches < 1:
            raise ValueError(f"--batch and --max-microbatches must be >= 1, got {args.batch}, {args.max_microbatches}")
        budget = parse_memory(args.memory, "--memory")
        result, _, facts = plan_model(
            args.model, _overrides(args.set), args.batch, budget, args.devices, _names(args.schedules),
            _names(args.checkpoints) or [], args.max_microbatches, args.bytes_per_param,
            cache=Path(args.cache) if args.cache else None, trials=args.trials)
    except NoPlanFits as exc:
        print(f"gpipe-plan: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"gpipe-plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**result.to_dict(), "model": args.model, **facts}, indent=2))
    else:
        print(result.describe(f"gpipe-plan auto --model {args.model}", facts))
    return 0


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    keys = {"num_layers": args.num_layers, "num_filters": args.num_filters,
            "image_size": args.image_size, "seq_len": args.seq_len}
    return {k: v for k, v in keys.items() if v is not None}


def plan_to_dict(plan: Plan) -> dict[str, object]:
    """A JSON-able summary of a plan (bytes in GiB)."""
    return {"balance": plan.balance, "params": plan.params, "fits": plan.fits,
            "capacity_gib": plan.capacity_bytes / GiB, "peak_gib": plan.peak_bytes / GiB,
            "partitions": [{"layers": p.layers, "params": p.params, "parameter_gib": p.parameter_bytes / GiB,
                            "activation_gib": p.activation_bytes / GiB} for p in plan.partitions]}


def assumptions(args: argparse.Namespace, sizes: Mapping[str, object], micro: int) -> dict[str, object]:
    """What a plan assumes, to print above its table (and in ``--json``)."""
    from gpipe_lab.models.preset_registry import AMOEBANET_PRESETS, DEFAULT_SEQ_LEN
    from gpipe_lab.models.transformer_presets import TRANSFORMER_PRESETS

    out: dict[str, object] = {"model": args.model, "K": args.partitions, "batch": args.batch, "M": micro}
    if args.model in AMOEBANET_PRESETS:
        preset = AMOEBANET_PRESETS[args.model]
        for key in ("num_layers", "num_filters", "image_size"):
            out[key] = sizes.get(key, preset[key])
    else:
        preset_cfg = TRANSFORMER_PRESETS[args.model][0] if args.model in TRANSFORMER_PRESETS else None
        out["num_layers"] = sizes.get("num_layers", getattr(preset_cfg, "num_layers", None))
        out["seq_len"] = sizes.get("seq_len", DEFAULT_SEQ_LEN.get(args.model))
    out.update({"rematerialization": not args.no_remat, "bytes_per_param": args.bytes_per_param,
                "activation_bytes": args.activation_bytes, "memory_gib": args.memory_gib})
    return out


def too_few_layers(model: str, layers: int, partitions: int) -> str:
    """The message for more partitions than layers, with the paper's size when there is one."""
    from gpipe_lab.models import TRANSFORMER_L_PAPER

    msg = (f"cannot cut {layers} layers into {partitions} partitions: --model {model} has {layers} layers "
           f"(stem/embedding and head included)")
    if model == "transformer_l":
        sizes = ", ".join(f"--num-layers {n} ({p})" for n, p in TRANSFORMER_L_PAPER.items())
        msg += (f"; the transformer_l preset is Table 1's 3-layer member; the paper's sizes: {sizes} "
                f"(K=128 used --num-layers 1663)")
    else:
        msg += "; pass a larger --num-layers or a smaller -K"
    return msg


def _print_assumptions(values: dict[str, object]) -> None:
    print("assumes: " + ", ".join(f"{k}={v}" for k, v in values.items()))


def _print_plan(plan: Plan) -> None:
    print(f"{'stage':>5} {'layers':>6} {'params':>14} {'param GiB':>10} {'act GiB':>9} {'total GiB':>10}")
    for k, p in enumerate(plan.partitions):
        print(f"{k:>5} {p.layers:>6} {p.params:>14,} {p.parameter_bytes / GiB:>10.3f} "
              f"{p.activation_bytes / GiB:>9.3f} {p.total_bytes / GiB:>10.3f}")
    verdict = "fits" if plan.fits else "does NOT fit"
    print(f"total params {plan.params:,}; peak {plan.peak_bytes / GiB:.3f} GiB per accelerator "
          f"{verdict} in {plan.capacity_bytes / GiB:g} GiB")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpipe-plan``; returns the exit status.

    Raises:
        SystemExit: bad arguments (argparse), or 2 for an invalid model size.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "auto":
        return _run_auto(args)
    for flag, value in (("--batch", args.batch), ("--microbatches", args.microbatches)):
        if value is not None and value < 1:  # 0 used to mean "default" (M) or divide by zero (N)
            parser.error(f"{flag} must be >= 1, got {value}")
    if not args.memory_gib > 0:
        parser.error(f"--memory-gib must be > 0, got {args.memory_gib:g}")
    sizes = _sizes(args)
    batch = args.batch
    micro = args.microbatches or batch
    remat = not args.no_remat
    scale = args.activation_bytes / 4
    capacity = args.memory_gib * GiB
    try:
        assumed = assumptions(args, sizes, micro)
        if args.command == "memory":
            records = layer_records(args.model, **sizes)
            if args.partitions > len(records):
                raise ValueError(too_few_layers(args.model, len(records), args.partitions))
            plan = best_plan(records, args.partitions, capacity, batch, micro, remat,
                             args.bytes_per_param, scale)
            if args.json:
                print(json.dumps({**plan_to_dict(plan), "assumptions": assumed}, indent=2))
            else:
                _print_assumptions(assumed)
                _print_plan(plan)
            return 0
        if args.model.startswith("amoebanet"):
            layers = sizes.pop("num_layers", 18)
            sizes.pop("num_filters", None)
            best = max_amoebanet_filters(layers, args.partitions, capacity, batch, micro, remat,
                                         activation_scale=scale, **sizes)
            result = {"model": args.model, "num_layers": layers, "max_num_filters": best}
            fitted = layer_records(args.model, num_layers=layers, num_filters=best, **sizes) if best else None
        else:
            sizes.pop("num_layers", None)
            best = max_transformer_layers(args.partitions, capacity, batch, micro, remat, args.model,
                                          activation_scale=scale, **sizes)
            result = {"model": args.model, "max_num_layers": best}
            fitted = layer_records(args.model, num_layers=best, **sizes) if best else None
        if fitted is not None:
            plan = best_plan(fitted, args.partitions, capacity, batch, micro, remat,
                             args.bytes_per_param, scale)
            result["plan"] = plan_to_dict(plan)
        print(json.dumps(result, indent=2) if args.json else
              "; ".join(f"{k}={v}" for k, v in result.items() if k != "plan"))
        if fitted is not None and not args.json:
            _print_assumptions({k: v for k, v in assumed.items() if k not in ("num_layers", "num_filters")})
            _print_plan(plan)
        return 0
    except ValueError as exc:
        print(f"gpipe-plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

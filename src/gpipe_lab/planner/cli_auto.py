"""``gpipe-plan auto``: the fastest plan (K, M, balance, schedule, checkpoint) that fits a memory budget.

    gpipe-plan auto --model transformer_tiny --batch 32 --memory 64MiB --devices 2
    gpipe-plan auto --model amoebanet_d_tiny --batch 64 --memory 8MiB --set num_filters=8 --json

The model's per-layer times and bytes are measured once and cached (``planner.profile_cache``);
the search (``planner.auto``) takes seconds; the ``--trials`` fastest predicted plans (3 by default)
then run a few steps each and the fastest measured is chosen (``planner.trials``). Exit status 2, with one line, when no plan fits: the
line names the smallest memory that would fit and the plan it would use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from gpipe_lab.planner.auto import CHECKPOINTS, NoPlanFits
from gpipe_lab.planner.auto_run import default_devices, format_result, plan_model
from gpipe_lab.planner.memory_size import parse_memory
from gpipe_lab.planner.trials import DEFAULT_TRIALS

__all__ = ["add_auto_parser", "run_auto"]


def add_auto_parser(sub: Any) -> None:
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
    p.add_argument("--max-microbatches", type=int, default=32)
    p.add_argument("--bytes-per-param", type=float, default=16.0,
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


def run_auto(args: argparse.Namespace) -> int:
    """Plan and print; returns the exit status (0, or 2 with one line on stderr).

    Raises:
        SystemExit: never itself (argparse's errors are raised before this runs).
    """
    try:
        if args.batch < 1 or args.max_microbatches < 1:
            raise ValueError(f"--batch and --max-microbatches must be >= 1, got {args.batch}, {args.max_microbatches}")
        budget = parse_memory(args.memory, "--memory")
        devices = default_devices() if args.devices is None else args.devices
        result, _, facts = plan_model(
            args.model, _overrides(args.set), args.batch, budget, devices, _names(args.schedules),
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
        print(format_result(result, f"gpipe-plan auto --model {args.model}", facts))
    return 0

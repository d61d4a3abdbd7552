"""The planner's defaults are written once: ``PlannerConfig`` (the app's ``pipeline.*`` planner keys)
and ``plan_types`` (the search's); the yaml restates the keys for Hydra with the same values, and the
CLI's flags default to the same constants."""

from __future__ import annotations

from dataclasses import asdict, fields

from omegaconf import OmegaConf

from gpipe_lab.app.config.planner import PLANNER_KEYS, PlannerConfig, validate_planner
from gpipe_lab.app.train import CONFIG_DIR
from gpipe_lab.planner import plan_types
from gpipe_lab.planner.cli import build_parser


def test_the_yaml_restates_the_dataclass_defaults() -> None:
    yaml = OmegaConf.to_container(OmegaConf.load(f"{CONFIG_DIR}/pipeline/default.yaml"))
    assert isinstance(yaml, dict)
    assert {k: yaml[k] for k in PLANNER_KEYS if k in yaml} == asdict(PlannerConfig())
    assert PLANNER_KEYS == tuple(f.name for f in fields(PlannerConfig))


def test_unset_keys_read_the_dataclass_defaults() -> None:
    checked = validate_planner(OmegaConf.create({"pipeline": {"partitions": 2}}))
    assert checked == PlannerConfig() and checked.budget_bytes is None and not checked.auto
    given = validate_planner(OmegaConf.create({"pipeline": {"plan": "auto", "memory_per_device": "2KiB"}}))
    assert given.auto and given.budget_bytes == 2048 and given.plan_trials == plan_types.DEFAULT_TRIALS


def test_the_cli_flags_default_to_the_search_defaults() -> None:
    args = build_parser().parse_args(["auto", "--memory", "1MiB"])
    assert args.trials == plan_types.DEFAULT_TRIALS
    assert args.max_microbatches == plan_types.MAX_MICROBATCHES
    assert args.bytes_per_param == plan_types.BYTES_PER_PARAM
    assert args.checkpoints.split(",") == list(plan_types.CHECKPOINTS)

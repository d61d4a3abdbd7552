"""One definition per option: ``conf/pipeline/`` is generated from ``PipelineOptions`` (every key
and default) plus the default run's own choices; the optimizer and the task come from ``_target_``."""

from __future__ import annotations

import inspect
from dataclasses import asdict, fields

import pytest
from omegaconf import OmegaConf

from gpipe_lab.app.config.groups import ConfigError, validate
from gpipe_lab.app.config.planner import PlannerConfig
from gpipe_lab.app.train import CONFIG_DIR, build_module
from gpipe_lab.lightning.modules import ImageClassifier, Translator, make_optimizer
from gpipe_lab.pipeline.options import PipelineOptions
from helpers.app import make_config

#: conf/pipeline/default.yaml's own choices for the default run (K=2 balanced by FLOPs).
APP_CHOICES = {"partitions": 2}
#: the planner's keys (the app's, not engine options: gpipe_lab.app.config.planner) and their defaults
PLANNER = asdict(PlannerConfig())


def test_pipeline_yaml_holds_only_the_default_runs_choices() -> None:
    yaml = OmegaConf.to_container(OmegaConf.load(f"{CONFIG_DIR}/pipeline/default.yaml"))
    assert yaml.pop("defaults") == ["schema", "_self_"]
    assert yaml == {**APP_CHOICES, **PLANNER}


def test_composed_pipeline_is_the_dataclass_defaults_and_the_choices() -> None:
    composed = OmegaConf.to_container(make_config().pipeline)
    defaults = {f.name: getattr(PipelineOptions(), f.name) for f in fields(PipelineOptions)}
    assert composed == {**defaults, **APP_CHOICES, **PLANNER}


def test_validate_returns_the_options_the_strategy_takes() -> None:
    options = validate(make_config("pipeline.chunks=8", "pipeline.schedule=1f1b")).options
    assert options == PipelineOptions(**{**APP_CHOICES, "chunks": 8, "schedule": "1f1b"})


def test_optimizer_default_learning_rate_is_one_value() -> None:
    adam = OmegaConf.load(f"{CONFIG_DIR}/optimizer/adam.yaml")
    signature = inspect.signature(make_optimizer).parameters
    assert (adam.name, adam.lr) == (signature["name"].default, signature["lr"].default)


@pytest.mark.parametrize(("overrides", "task", "optimizer"), [
    ((), ImageClassifier, "Adam"),
    (("model=transformer_tiny", "data=synthetic_translation", "optimizer=sgd"), Translator, "SGD"),
])
def test_task_and_optimizer_are_instantiated_from_target(overrides, task, optimizer) -> None:
    cfg = make_config(*overrides)
    module = build_module(cfg, datamodule=None)
    assert type(module) is task
    opt = module.configure_optimizers()
    assert type(opt).__name__ == optimizer and opt.param_groups[0]["lr"] == cfg.optimizer.lr


def test_optimizer_key_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.lr: must be a number >= 0, got 'fast'"):
        validate(make_config("optimizer.lr=fast"))
    with pytest.raises(ConfigError, match=r"optimizer\.nesterov: unknown key"):
        validate(make_config("+optimizer.nesterov=true"))


#: Until the engine lists every built-in schedule in its registry (not registered on import).


@pytest.mark.parametrize("transport", ["local", "distributed"])
def test_interleaved_schedule_with_virtual_stages_is_accepted(transport: str) -> None:
    options = validate(make_config("pipeline.schedule=interleaved-1f1b", f"pipeline.transport={transport}",
                                   "pipeline.virtual_stages=2", "trainer.devices=2")).options
    assert (options.schedule, options.virtual_stages, options.transport) == ("interleaved-1f1b", 2, transport)


@pytest.mark.parametrize("schedule", ["zb-v", "v-gpipe"])
def test_v_shaped_and_registered_schedules_are_accepted_with_their_virtual_stages(schedule: str) -> None:
    """``pipeline.schedule=`` takes the V-shaped schedules and a name ``register_schedule`` added,
    and refuses a virtual-stage count the schedule has no form for, naming the key."""
    from helpers.schedules import registered, v_fill_drain

    with registered("v-gpipe", virtual_form=v_fill_drain, placement="v", virtual_stages=[2]):
        options = validate(make_config(f"pipeline.schedule={schedule}", "pipeline.virtual_stages=2",
                                       "pipeline.cost=params")).options
        assert (options.schedule, options.virtual_stages) == (schedule, 2)
        with pytest.raises(ConfigError, match=rf"pipeline.virtual_stages: schedule '{schedule}' has no form with "
                                              r"virtual_stages=1"):
            validate(make_config(f"pipeline.schedule={schedule}"))
        plan = validate(make_config("pipeline.plan=auto", "pipeline.memory_per_device=1GiB",
                                    f"pipeline.schedules_allowed=[{schedule}]"))
        assert plan.planner.schedules_allowed == (schedule,)
    with pytest.raises(ConfigError, match=r"pipeline.schedule: must be one of .*'zb-v'.*got 'v-gpipe'"):
        validate(make_config("pipeline.schedule=v-gpipe", "pipeline.virtual_stages=2"))


def test_cost_auto_is_accepted_and_measures_what_the_engine_measures_given_a_sample() -> None:
    """``pipeline.cost=auto`` (the engine's default): the app always has the preset's sample, so
    the costs are the FLOPs ones (``costs.AUTO_MEASURED``)."""
    from gpipe_lab.app.train import engine_options
    from gpipe_lab.pipeline.measuring.costs import AUTO_MEASURED

    costs = {}
    for kind in ("auto", AUTO_MEASURED):
        cfg = make_config(f"pipeline.cost={kind}", "pipeline.partitions=2")
        checked = validate(cfg)
        costs[kind] = engine_options(cfg, checked.options, build_module(cfg, datamodule=None)).cost
    assert isinstance(costs["auto"], list) and costs["auto"] == costs[AUTO_MEASURED]
    with pytest.raises(ConfigError, match=r"pipeline.cost: must be one of \['auto', 'params'.*got 'vibes'"):
        validate(make_config("pipeline.cost=vibes"))

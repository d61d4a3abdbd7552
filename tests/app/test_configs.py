"""Every config file composes, validates and instantiates; bad configs fail naming the key;
every experiment file runs one step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from gpipe_lab.app.config.groups import ConfigError, validate
from gpipe_lab.app.train import CONFIG_DIR, build_logger, build_module, model_overrides, run
from helpers.app import make_config

CONF = Path(CONFIG_DIR)
GROUPS = ("model", "data", "pipeline", "trainer", "logger", "optimizer", "paths")
FILES = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
#: Experiments whose model is larger than this only compose and validate in the tests.
MAX_TEST_PARAMS = 12_000_000


@pytest.mark.parametrize(("group", "name"), FILES, ids=[f"{g}/{n}" for g, n in FILES])
def test_every_config_file_composes_and_instantiates(group: str, name: str, tmp_path: Path) -> None:
    overrides = [f"{group}={name}"]
    if (group, name[:11]) in (("model", "transformer"), ("data", "synthetic_t"), ("data", "parallel_te")):
        overrides.append("model=transformer_tiny" if group == "data" else "data=synthetic_translation")
    if group == "trainer" and name == "distributed":
        overrides.append("pipeline.transport=distributed")
    cfg = make_config(*overrides, tmp_path=tmp_path)
    if group == "trainer" and name == "gpu" and not torch.cuda.is_available():
        validate(cfg)
        pytest.skip("no GPU to instantiate a GPU trainer")
    validate(cfg)
    if group == "model":
        from gpipe_lab.models import build

        options = model_overrides(cfg)
        layers = build(cfg.model.name, device="meta", **options)
        assert len(layers) >= 2
    elif group == "data":
        from gpipe_lab.app.train import build_datamodule

        if "root" in cfg.data:
            with pytest.raises((FileNotFoundError, RuntimeError, ValueError)):
                build_datamodule(cfg)  # real data is not on these machines
        else:
            assert build_datamodule(cfg) is not None
    elif group == "trainer":
        import lightning.pytorch as pl

        pl.Trainer(**{**cfg.trainer, "devices": 1}, logger=False)
    elif group == "logger":
        with open_dict(cfg):
            if name == "wandb":
                cfg.logger.mode = "disabled"
        logger = build_logger(validate(cfg), tmp_path / "run")
        assert (logger is False) == (name == "none")
        if name == "wandb":
            import wandb

            wandb.finish()
    elif group == "optimizer":
        from gpipe_lab.app.train import build_datamodule

        module = build_module(cfg, build_datamodule(cfg))
        assert module.configure_optimizers() is not None


@pytest.mark.parametrize(("override", "key"), [
    ("+pipeline.stages=3", "pipeline.stages"),
    ("+model.depth=3", "model.depth"),
    ("+data.colour=red", "data.colour"),
    ("+trainer.max_stepz=3", "trainer.max_stepz"),
    ("+bogus=1", "bogus"),
    ("pipeline.checkpoint=sometimes", "pipeline.checkpoint"),
    ("pipeline.schedule=zigzag", "pipeline.schedule"),
    ("pipeline.transport=pigeon", "pipeline.transport"),
    ("pipeline.chunks=0", "pipeline.chunks"),
    ("pipeline.chunks=many", "pipeline.chunks"),
    ("pipeline.chunks=64", "pipeline.chunks"),  # > data.batch_size=32
    ("pipeline.cost=vibes", "pipeline.cost"),
    ("logger.mode=sometimes", "logger.mode"),
    ("optimizer.name=lbfgs", "optimizer.name"),
    ("model.name=resnet", "model.name"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("data.num_train=16", "data.batch_size"),  # 32 per batch: no full batch in an epoch
])
def test_bad_configs_name_the_key(override: str, key: str) -> None:
    cfg = make_config(override)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("+", "")):
        validate(cfg)


def test_impossible_combinations() -> None:
    with pytest.raises(ConfigError, match="pipeline.partitions: 12 partitions"):
        validate(make_config("pipeline.partitions=12"), num_layers=9)
    with pytest.raises(ConfigError, match=r"pipeline\.balance"):
        validate(make_config("pipeline.partitions=null", "pipeline.balance=[4,4]"), num_layers=9)
    with pytest.raises(ConfigError, match=r"trainer\.devices: world size 3"):
        validate(make_config("pipeline.transport=distributed", "trainer.devices=3"))


def test_validation_happens_before_building(tmp_path: Path) -> None:
    cfg = make_config("pipeline.partitions=12", "logger=none", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match="partitions"):
        run(cfg)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_runs_one_step(name: str, tmp_path: Path) -> None:
    # one validation batch runs the evaluation path; the test pass would run it again (greedy decoding of
    # a 12 + 12 layer model in the Table 3 config)
    cfg = make_config(f"experiment={name}", "trainer=smoke", "trainer.max_steps=1", "trainer.limit_val_batches=1",
                      "trainer.limit_test_batches=0", "logger=none", tmp_path=tmp_path)
    validate(cfg)
    if "root" in cfg.data and not Path(cfg.data.root).exists():
        pytest.skip(f"{name}: needs local data at {cfg.data.root}")
    from gpipe_lab.models import build

    options = model_overrides(cfg)
    size = sum(p.numel() for p in build(cfg.model.name, device="meta", **options).parameters())
    if size > MAX_TEST_PARAMS:
        pytest.skip(f"{name}: {size / 1e6:.0f}M parameters is too big for a CPU test step")
    if int(cfg.pipeline.get("chunks") or 1) > 8:  # validated above as written; one step of M=8 runs the same code
        cfg.pipeline.chunks = 8
    small = max(16, 2 * int(cfg.pipeline.get("chunks") or 1))  # two samples per micro-batch
    if (cfg.data.get("batch_size") or 0) > small:  # one step proves the config runs; keep it short
        cfg.data.batch_size = small
    summary = run(cfg)
    assert summary["steps"] == 1
    assert summary["final_train_loss"] is not None


def test_experiment_root_keys_win_over_train_yaml() -> None:
    """train.yaml lists _self_ first, so an experiment may set root keys (tags, dry_run)."""
    assert list(make_config().tags) == []
    assert list(make_config("experiment=transformer_tiny").tags) == ["transformer", "translation"]
    assert make_config("experiment=paper_table1_capacity").dry_run is True
    assert make_config("experiment=paper_table1_capacity", "dry_run=false").dry_run is False

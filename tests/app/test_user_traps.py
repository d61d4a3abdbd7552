"""A new user's mistakes are caught before training, with one line naming the keys to fix.

Model/data mismatch, a zero accumulation, misspelled keys and options (``did you mean``),
a missing or damaged dataset (no traceback, a hint Hydra accepts), and a sweep with a bad job
(every job checked before the first trains).
"""

from __future__ import annotations

import pytest

from gpipe_lab.app.config.groups import ConfigError, validate
from gpipe_lab.app.suggest import suggest_overrides
from gpipe_lab.app.train import CONFIG_DIR
from helpers.app import SMALL, make_config, user_app

app = user_app


@pytest.mark.parametrize("overrides,named", [
    (["model=transformer_tiny"], "model=transformer_tiny data=synthetic_images"),
    (["data=synthetic_translation"], "model=amoebanet_d_tiny data=synthetic_translation"),
    (["model=amoebanet_d_tiny", "data=parallel_text"], "model=amoebanet_d_tiny data=parallel_text"),
])
def test_model_and_data_that_do_not_fit_fail_in_validation_naming_both_and_a_working_pair(overrides, named):
    with pytest.raises(ConfigError, match="working pair: model=") as info:
        validate(make_config(*overrides))
    assert named in str(info.value) and "\n" not in str(info.value)


def test_the_working_pairs_pass():
    validate(make_config("experiment=transformer_tiny"))
    validate(make_config("model=transformer_tiny", "data=synthetic_translation"))
    validate(make_config("data=cifar10"))


@pytest.mark.parametrize("key", ["accumulate_grad_batches", "log_every_n_steps"])
def test_zero_trainer_counts_are_refused(key):
    with pytest.raises(ConfigError, match=f"trainer.{key}: must be a positive integer, got 0"):
        validate(make_config(f"trainer.{key}=0"))


def test_misspelled_keys_and_options_get_the_closest_valid_one():
    hints = suggest_overrides(CONFIG_DIR, ["pipeline.chunk=4", "model=transformer_tny", "sed=3",
                                           "experiment=transformer_tiny", "model.d_modl=8", "pipeline.chunks=2",
                                           "+data.extra=1", "-m"])
    assert hints[0].startswith("model=transformer_tny: no such option; did you mean model=transformer_tiny? "
                               "(options: amoebanet_b, ")
    assert hints[1:] == [
                     "pipeline.chunk: not a key of the config; did you mean pipeline.chunks?",
                     "sed: not a key of the config; did you mean seed?",
                     "model.d_modl: not a key of the config; did you mean model.d_model?"]


def test_gpipe_train_prints_the_labs_hint_instead_of_hydras_error(tmp_path):
    proc = app(["trainer.max_step=3"], tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "trainer.max_step: not a key of the config; did you mean trainer.max_steps?"


def test_missing_cifar_is_one_line_with_an_override_hydra_accepts(tmp_path):
    proc = app(["data=cifar10", f"data.root={tmp_path / 'none'}", *SMALL[:2]], tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "data error: CIFAR-10 file not found" in proc.stderr and "data.download=true" in proc.stderr
    # the hint's override composes (download is a key of the CIFAR configs)
    assert make_config("data=cifar10", "data.download=true").data.download is True


def test_cifar_files_failing_the_checksum_get_the_labs_message(tmp_path):
    from torchvision import datasets

    from gpipe_lab.data import build_datamodule
    from gpipe_lab.data.checks import DataNotFoundError

    folder = tmp_path / datasets.CIFAR10.base_folder
    folder.mkdir()
    for name, _ in datasets.CIFAR10.train_list + datasets.CIFAR10.test_list:
        (folder / name).write_bytes(b"not cifar")
    dm = build_datamodule("cifar10", root=str(tmp_path))  # passes the lab's file check
    with pytest.raises(DataNotFoundError, match="fail torchvision's checksum.*data.download=true"):
        dm.setup("fit")


@pytest.mark.slow
def test_a_sweep_with_a_bad_job_stops_before_any_job_trains_and_names_it(tmp_path):
    proc = app(["-m", "pipeline.chunks=4,64,2", *SMALL], tmp_path)
    assert proc.returncode == 1
    assert "config error in 1 of 3 sweep jobs" in proc.stderr
    assert "job 1 (pipeline.chunks=64" in proc.stderr and "job 0" not in proc.stderr
    assert not list(tmp_path.rglob("summary.json"))  # nothing trained


@pytest.mark.slow
def test_a_valid_sweep_still_runs_every_job(tmp_path):
    proc = app(["-m", "pipeline.chunks=1,2", *SMALL, "trainer.max_steps=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(tmp_path.glob("train/multiruns/*/[0-9]/summary.json"))) == 2
    sweep_dir = next(tmp_path.glob("train/multiruns/*"))
    last = proc.stdout.strip().splitlines()[-1]  # the sweep ends by naming its table files
    assert str(sweep_dir / "sweep_summary.md") in last and str(sweep_dir / "summary.csv") in last


def test_an_added_key_unknown_to_its_group_names_the_closest_one():
    with pytest.raises(ConfigError, match="model.num_filterz: unknown key .*did you mean model.num_filters\\?"):
        validate(make_config("+model.num_filterz=8"))


def test_lightning_info_lines_are_printed_once(tmp_path):
    proc = app([*SMALL, "data.num_train=16", "trainer.max_steps=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count("Seed set to 0") == 1 and out.count("`Trainer.fit` stopped") == 1, out[-3000:]
    assert "litlogger" not in out and "powered by Hydra" not in out, out[-3000:]
    (first,) = tmp_path.rglob("timeline_first.png")  # one step: its picture is drawn once, then copied
    assert first.with_name("timeline_last.png").read_bytes() == first.read_bytes()

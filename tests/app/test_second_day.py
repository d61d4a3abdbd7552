"""A user's second day (issue 31), driven through ``gpipe-train`` as a user runs it.

Sweeps and dry runs make every check of the single run first (K against the model's layers),
a sweep whose job fails keeps the table of the finished ones and says where it is, and a
user's mistake (a missing checkpoint, no GPU, no internet) is one line naming the value and a fix.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from helpers.app import SMALL, Done, cli_here, one_line, user_app

app = user_app


@pytest.fixture
def gpipe_train(tmp_path, capsys, monkeypatch) -> Callable[..., Done]:
    """``gpipe-train ARGS`` in this process (``helpers.app.cli_here``)."""
    return cli_here(tmp_path, capsys, monkeypatch)


def test_a_dry_run_checks_k_against_the_models_layers_and_leaves_no_run_folder(tmp_path):
    proc = app(["dry_run=true", "pipeline.partitions=20"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["config error: pipeline.partitions: 20 partitions but model 'amoebanet_d_tiny' has only "
                     "9 layers"], proc.stderr
    assert not list(tmp_path.rglob("*.yaml")), "a refused run leaves no run folder behind"


def test_a_sweep_checks_k_against_the_models_layers_before_any_job_trains(gpipe_train, tmp_path):
    done = gpipe_train("-m", "pipeline.partitions=1,2,20", "pipeline.chunks=4", *SMALL)
    assert isinstance(done.code, str) and "config error in 1 of 3 sweep jobs" in done.code
    assert "job 2 (pipeline.partitions=20" in done.code and "has only 9 layers" in done.code
    assert "job 0" not in done.code and "job 1" not in done.code
    assert not list(tmp_path.rglob("summary.json"))  # nothing trained


@pytest.mark.slow
def test_a_sweep_whose_job_fails_keeps_the_table_of_the_finished_jobs(gpipe_train, tmp_path):
    # lr=1e30 passes the checks and fails while the job runs: the second step's loss is not finite
    done = gpipe_train("-m", "optimizer.lr=0.001,1e30", *SMALL, "trainer.max_steps=2")
    assert done.code != 0
    tables = list(tmp_path.glob("train/multiruns/*/sweep_summary.md"))
    assert len(tables) == 1, done.out[-2000:] + done.err[-2000:]
    assert "1 jobs" in tables[0].read_text()
    assert f"the table of the 1 finished job(s): {tables[0]}" in done.out


def test_a_checkpoint_that_does_not_exist_is_one_line(gpipe_train, tmp_path):
    line = one_line(gpipe_train("ckpt_path=/nowhere/last.ckpt", *SMALL))
    assert "ckpt_path=/nowhere/last.ckpt: no such file" in line and "ckpt_path=last" in line
    assert "quote a path holding '='" in line
    assert not list(tmp_path.rglob("*.yaml")), "a refused run leaves no run folder behind"


def test_ckpt_path_last_without_any_run_is_one_line(gpipe_train):
    line = one_line(gpipe_train("ckpt_path=last", *SMALL))
    assert "ckpt_path=last: no run under" in line and "train one first" in line


def test_init_from_a_missing_file_is_one_line(gpipe_train):
    line = one_line(gpipe_train("init_from=/nowhere/last.ckpt", *SMALL))
    assert "init_from=/nowhere/last.ckpt: no such file" in line


def test_trainer_gpu_without_a_gpu_is_one_line(gpipe_train, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = one_line(gpipe_train("trainer=gpu", *SMALL[1:]))
    assert "trainer.accelerator=gpu: no CUDA GPU is visible" in line and "trainer=cpu" in line


def test_download_without_internet_is_one_line_before_any_logger_starts(gpipe_train, tmp_path, monkeypatch):
    for proxy in ("https_proxy", "http_proxy", "HTTPS_PROXY", "HTTP_PROXY"):  # a proxy refusing every
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")                        # connection: no internet
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    line = one_line(gpipe_train("data=cifar10", "data.download=true", f"data.root={tmp_path / 'cifar'}",
                                "logger=wandb", "trainer=smoke", "data.batch_size=8"))
    assert "data.download=true: fetching cifar10 failed" in line and "data.download=false" in line
    assert not list(tmp_path.rglob("wandb")), "no wandb run was started"


def test_the_labs_hint_comes_first_and_prefers_the_everyday_presets(gpipe_train):
    done = gpipe_train("pipeline.chunk=4")
    assert done.code == "pipeline.chunk: not a key of the config; did you mean pipeline.chunks?"
    done = gpipe_train("model=transfomer")
    assert isinstance(done.code, str) and done.code.startswith(
        "model=transfomer: no such option; did you mean model=transformer_tiny? (options: ")
    assert "Hydra" not in done.err and "+pipeline.chunk" not in done.err


def test_an_unquoted_lightning_checkpoint_name_gets_the_quoting_rule(gpipe_train, tmp_path):
    done = gpipe_train(f"ckpt_path={tmp_path}/epoch=0-step=60.ckpt")
    assert done.code == (f"ckpt_path={tmp_path}/epoch=0-step=60.ckpt: a value holding '=' must be quoted for "
                         f"Hydra, quotes included in the shell: \"ckpt_path='{tmp_path}/epoch=0-step=60.ckpt'\"")


def test_help_opens_with_what_the_app_does_and_its_everyday_commands(gpipe_train):
    done = gpipe_train("--help")
    assert done.code in (0, None), done.err[-2000:]
    assert done.out.startswith("gpipe-train: train a network with GPipe pipeline parallelism")
    assert "powered by Hydra" not in done.out and "gpipe-train ckpt_path=last" in done.out


def test_a_run_keeps_one_checkpoint_file(gpipe_train, tmp_path):
    done = gpipe_train(*SMALL, "trainer.max_steps=2", "trainer.enable_checkpointing=true")
    assert done.code in (0, None), done.err[-3000:]
    assert [p.name for p in tmp_path.rglob("*.ckpt")] == ["last.ckpt"]
    assert done.out.strip().splitlines()[-1].startswith("summary: K=2 M=4 train_loss=")
    # the stages, not Lightning's one-row summary with 0 FLOPs
    assert "pipeline: K=2 M=4 schedule=gpipe" in done.out and "  stage 1: layers " in done.out, done.out
    assert "Total FLOPs" not in done.out + done.err


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_torchrun_world_size_that_k_does_not_divide_is_one_line_on_rank_0_only(gpipe_train, monkeypatch, rank):
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun --nproc-per-node 3 gives each process
    monkeypatch.setenv("RANK", rank)
    done = gpipe_train("pipeline.transport=distributed", "trainer=distributed", *SMALL[1:], "dry_run=true")
    if rank == "1":
        assert done.code == 1 and done.err == "", done
        return
    line = one_line(done)
    assert "torchrun started 3 processes" in line and "--nproc-per-node 2" in line


def test_a_dry_run_checks_virtual_stages_against_the_models_layers(gpipe_train):
    line = one_line(gpipe_train("dry_run=true", "pipeline.partitions=4", "pipeline.virtual_stages=3",
                                "pipeline.schedule=interleaved-1f1b"))
    assert "pipeline.virtual_stages: 4 partitions x 3 virtual stages = 12 chunks but model 'amoebanet_d_tiny' " \
           "has only 9 layers" in line, line

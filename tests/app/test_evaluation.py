"""Test sets through ``gpipe-train`` (issue 46): a finished run tests its final model on the data's
test split and reports it (summary.json, wandb); ``mode=validate|test`` evaluates a checkpoint
without training; ``parallel_text`` reads ``data.test_src``/``data.test_ref`` and scores BLEU."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpipe_lab.app.train import build_datamodule, build_module
from gpipe_lab.app.wandb_reader import find_run_files, read_run
from gpipe_lab.data import SyntheticLanguagePair
from helpers.app import SMALL, cli_here, make_config

#: SMALL with a test split of one batch, logged to wandb, keeping its checkpoint
IMAGES = [*(o for o in SMALL if o != "logger=none"), "logger=wandb", "data.num_test=8", "trainer.max_steps=2",
          "trainer.enable_checkpointing=true"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A small image run that trained 2 steps (and tested its final model)."""
    tmp_path = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:
        done = cli_here(tmp_path, _Capture(), mp)(*IMAGES, "hydra.run.dir=trained")
    assert done.code in (0, None), done.err[-3000:]
    return tmp_path / "trained"


class _Capture:
    """``capsys``' one method ``cli_here`` calls, for a module-scoped fixture (nothing captured)."""

    def readouterr(self) -> SimpleNamespace:
        return SimpleNamespace(out="", err="")


def test_a_finished_run_reports_its_test_metrics_as_the_unpipelined_model_computes_them(trained) -> None:
    summary = _summary(trained)
    assert summary["test_metric"] == "test/acc" and summary["test_value"] == summary["test/acc"], summary
    # the final model's weights, unpipelined, on the same 8 test images (one batch)
    cfg = make_config(*IMAGES)
    datamodule = build_datamodule(cfg)
    module = build_module(cfg, datamodule)
    module.load_state_dict(torch.load(trained / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"])
    module.eval()
    ((images, labels),) = list(datamodule.test_dataloader())
    with torch.no_grad():
        outputs = module.layers(images)
    assert summary["test/loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(outputs, labels)), abs=1e-5)
    assert summary["test/acc"] == pytest.approx(float((outputs.argmax(-1) == labels).float().mean()), abs=1e-6)
    (wandb_file,) = find_run_files(trained / "wandb")
    run = read_run(wandb_file)
    assert run.metric("test/acc") == [summary["test/acc"]] and run.summary["test_value"] == summary["test_value"]


@pytest.mark.parametrize("mode", ["validate", "test"])
def test_mode_evaluates_a_checkpoint_without_training(trained, tmp_path, capsys, monkeypatch, mode) -> None:
    done = cli_here(tmp_path, capsys, monkeypatch)(*IMAGES, f"mode={mode}",
                                                   f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}")
    assert done.code in (0, None), done.err[-3000:]
    (run_dir,) = tmp_path.glob("train/runs/*")
    summary, final = _summary(run_dir), _summary(trained)
    assert summary["mode"] == mode and summary["evaluated"] == str(trained / "checkpoints" / "last.ckpt")
    keys = ["val_loss", "validation_value"] if mode == "validate" else ["test/loss", "test/acc", "test_value"]
    assert {k: summary[k] for k in keys} == {k: final[k] for k in keys}  # the final model's, exactly
    assert not (run_dir / "checkpoints").exists() and summary["final_train_loss"] is None  # nothing trained
    assert summary["steps"] == final["steps"] == 2 and summary["fit_seconds"] is None
    last = done.out.strip().splitlines()[-1]
    assert last.startswith("summary: K=2 M=4 ") and ("test/acc=" in last) == (mode == "test"), last
    assert f"evaluating {trained / 'checkpoints' / 'last.ckpt'} of run {trained}" in done.out, done.out


def test_mode_test_without_a_checkpoint_or_a_test_set_is_one_line(trained, tmp_path, capsys, monkeypatch) -> None:
    gpipe_train = cli_here(tmp_path, capsys, monkeypatch)
    done = gpipe_train(*IMAGES, "mode=test", "data.num_test=0", f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}")
    assert done.code == "config error: mode=test: data=synthetic_images has no test set here; set data.num_test above 0"
    assert gpipe_train(*SMALL, "mode=test").code == ("config error: mode=test: give the checkpoint to evaluate, "
                                                    "ckpt_path=<run dir>/checkpoints/last.ckpt (or ckpt_path=last, "
                                                    "the newest run's)")
    assert gpipe_train(*SMALL, "data.num_test=-1").code == ("config error: data.num_test: must be an integer >= 0 "
                                                            "(0: no test split), got -1")
    assert gpipe_train(*SMALL, "mode=fit").code == "config error: mode: must be one of ['train', 'validate', 'test'], got 'fit'"


def _write_corpus(root: Path, sizes: dict[str, int]) -> None:
    lang, rng = SyntheticLanguagePair(0), random.Random(0)
    root.mkdir(parents=True)
    for split, n in sizes.items():
        pairs = [lang.sample(rng, 3, 6) for _ in range(n)]
        (root / f"{split}.src").write_text("".join(" ".join(s) + "\n" for s, _ in pairs))
        (root / f"{split}.tgt").write_text("".join(" ".join(t) + "\n" for _, t in pairs))


def test_parallel_text_reads_its_test_files_and_reports_test_bleu(tmp_path, capsys, monkeypatch) -> None:
    corpus = tmp_path / "corpus"
    _write_corpus(corpus, {"train": 64, "valid": 8, "test": 12})
    gpipe_train = cli_here(tmp_path, capsys, monkeypatch)
    done = gpipe_train("experiment=transformer_tiny", "data=parallel_text", f"data.root={corpus}",
                       f"data.test_src={corpus / 'test.src'}", f"data.test_ref={corpus / 'test.tgt'}",
                       "data.vocab_size=200", "data.tokens_per_batch=null", "data.batch_size=8", "logger=csv",
                       "trainer=smoke", "trainer.max_steps=2", "model.d_model=32", "model.ffn_dim=64",
                       "trainer.limit_test_batches=null")
    assert done.code in (0, None), done.err[-3000:]
    (run_dir,) = tmp_path.glob("train/runs/*")
    summary = _summary(run_dir)
    assert summary["test_metric"] == "test/bleu" and 0.0 <= summary["test_value"] <= 100.0, summary
    assert "test/token_acc" in summary and "test/bleu=" in done.out.strip().splitlines()[-1]
    (metrics_csv,) = run_dir.rglob("metrics.csv")
    assert "test/bleu" in metrics_csv.read_text().splitlines()[0]

"""Test-set evaluation in ``gpipe-train``, chosen by the root key ``mode`` (checked by
``gpipe_lab.app.config.groups.validate_mode``).

- ``mode=train`` (the default): train, then test the final model (``final_test``) on the data's test split when
  it has one (``data.num_test`` of the synthetic tasks, ``data.test_src``/``data.test_ref`` of
  ``parallel_text``; ``trainer.limit_test_batches=0`` skips it);
- ``mode=validate`` / ``mode=test``: evaluate the checkpoint ``ckpt_path`` on the validation /
  test set without training (Lightning's ``Trainer.validate`` / ``Trainer.test``), with the
  checkpoint's run's overrides (``gpipe_lab.app.continuation``) and a wandb run of its own.

The test metrics (``test/loss`` and ``test/acc``, or ``test/bleu`` by sacrebleu over the whole
test set and ``test/token_acc``) go to the loggers (wandb's history), and to ``summary.json``
and wandb's summary under their own names and as ``test_metric`` / ``test_value`` /
``test_loss``.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from gpipe_lab.app.config.schema import ConfigError

#: How each dataset gets a test split, for the error of ``mode=test`` without one.
TEST_SET_HINT = {
    "parallel_text": "set data.test_src and data.test_ref (plain-text files, sacrebleu's format)",
    "synthetic_images": "set data.num_test above 0", "synthetic_translation": "set data.num_test above 0",
}


def evaluates(cfg: DictConfig) -> bool:
    """Whether the run evaluates ``ckpt_path`` (``mode=validate|test``) instead of training."""
    return cfg.get("mode", "train") != "train"


def check_test_set(cfg: DictConfig, datamodule: Any) -> None:
    """Raises: ConfigError: ``mode=test`` and the data has no test split (naming how to give one)."""
    if cfg.get("mode", "train") == "test" and not getattr(datamodule, "has_test_set", False):
        hint = TEST_SET_HINT.get(cfg.data.name, "its validation split is the dataset's test split: use mode=validate")
        raise ConfigError(f"mode=test: data={cfg.data.name} has no test set here; {hint}")


def check_weights(ckpt_path: str, module: torch.nn.Module) -> None:
    """Raises: ConfigError: the checkpoint's weights do not fit ``module`` (names or shapes)."""
    from gpipe_lab.app.config.resume_checks import differing_weights

    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    bad = differing_weights(state, module)
    if bad:
        more = " ..." if len(bad) > 4 else ""
        raise ConfigError(f"ckpt_path={ckpt_path}: cannot evaluate it, this run's model differs in {len(bad)} "
                          f"weight(s): {'; '.join(bad[:4])}{more}")


def summarize_test(results: dict[str, float]) -> dict[str, Any]:
    """Summary keys of ``Trainer.test``'s metrics: theirs, and ``test_metric`` / ``test_value`` / ``test_loss``."""
    key = next((k for k in ("test/acc", "test/bleu") if k in results), None)
    return {**results, "test_metric": key, "test_value": results.get(key) if key else None,
            "test_loss": results.get("test/loss")}


def final_test(trainer: Any, module: Any, datamodule: Any, metrics: Any) -> None:
    """After training: test the final model when the data has a test split (and
    ``trainer.limit_test_batches`` is not 0); its metrics join the summary."""
    if not getattr(datamodule, "has_test_set", False) or not trainer.limit_test_batches:
        return
    results = trainer.test(module, datamodule=datamodule, verbose=False)[0]
    metrics.add_to_summary(trainer, summarize_test(results))


def evaluate_checkpoint(mode: str, trainer: Any, module: Any, datamodule: Any, metrics: Any, ckpt_path: str) -> None:
    """``mode=validate`` / ``mode=test``: evaluate ``ckpt_path`` without training; the summary holds
    the metrics (the validation ones as a trained run's do) and, as ``steps``, the checkpoint's step."""
    from gpipe_lab.app.wandb_run import checkpoint_step

    evaluate = trainer.validate if mode == "validate" else trainer.test
    results = evaluate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)[0]
    metrics.write_summary(trainer)
    # the evaluated model's training steps (this run trains none)
    metrics.add_to_summary(trainer, {"steps": checkpoint_step(ckpt_path),
                                     **(summarize_test(results) if mode == "test" else {})})

"""Checks of a first-time user's mistakes, run by ``gpipe_lab.app.config.groups.validate``.

A model and dataset of different tasks, trainer counts Lightning only rejects inside ``fit``,
and an experiment's ``transfer`` keys that gpipe-train would otherwise ignore.
"""

from __future__ import annotations

from omegaconf import DictConfig

from gpipe_lab.app.config.schema import ConfigError, check_positive

#: Which datamodules feed which model family (a translation model cannot read images).
DATA_OF_FAMILY = {"amoebanet": ("synthetic_images", "cifar10", "cifar100", "imagenet"),
                  "transformer": ("synthetic_translation", "parallel_text")}
#: A pair known to work, for each family, to show in the error.
WORKING_PAIR = {"amoebanet": "model=amoebanet_d_tiny data=synthetic_images",
                "transformer": "model=transformer_tiny data=synthetic_translation (or experiment=transformer_tiny)"}


def validate_model_data(cfg: DictConfig) -> None:
    """The model and the dataset belong to the same task (images or translation).

    Raises:
        ConfigError: one line naming ``model=`` and ``data=`` and a pair that works.
    """
    from gpipe_lab.models.preset_registry import AMOEBANET_PRESETS

    model, data = cfg.model.get("name"), cfg.data.get("name")
    family = "amoebanet" if model in AMOEBANET_PRESETS else "transformer"
    if data not in DATA_OF_FAMILY[family]:
        kind = "an image classifier" if family == "amoebanet" else "a translation model"
        raise ConfigError(f"model={model} data={data}: {kind} needs one of data={'|'.join(DATA_OF_FAMILY[family])}; "
                          f"a working pair: {WORKING_PAIR[family]}")


def validate_trainer_values(cfg: DictConfig) -> None:
    """Trainer values Lightning only rejects deep inside ``fit`` (or with a ZeroDivisionError).

    Raises:
        ConfigError: naming the key, for a non-positive ``accumulate_grad_batches`` or
            ``log_every_n_steps`` below 1.
    """
    for key in ("accumulate_grad_batches", "log_every_n_steps"):
        value = cfg.trainer.get(key)
        if value is not None:
            check_positive(value, f"trainer.{key}")


def validate_transfer(cfg: DictConfig) -> None:
    """An experiment's ``transfer`` block as gpipe-train reads it: ``transfer.lr`` and
    ``transfer.steps`` reach it through ``optimizer.lr`` and ``trainer.max_steps`` (the
    ``transfer_*`` configs interpolate them); the loop-only augmentation is refused.

    Raises:
        ConfigError: ``transfer.random_flip`` or ``transfer.cutout`` set (only
            ``experiments/transfer.py``'s loop applies them; gpipe-train uses ``data.random_flip`` /
            ``data.cutout``).
    """
    transfer = cfg.get("transfer")
    if transfer is None:
        return
    for key, data_key in (("random_flip", "random_flip"), ("cutout", "cutout")):
        if transfer.get(key):
            raise ConfigError(f"transfer.{key}: only experiments/transfer.py's loop applies it; gpipe-train "
                              f"augments through data.{data_key} (set transfer.{key} off and data.{data_key} instead)")

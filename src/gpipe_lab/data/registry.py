"""``build_datamodule(name, **kwargs)``: every datamodule by name, for the Hydra app."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import lightning.pytorch as pl

from gpipe_lab.data.image_datamodule import SyntheticImageDataModule
from gpipe_lab.data.parallel_text import ParallelTextDataModule
from gpipe_lab.data.real_images import CIFARDataModule, ImageNetDataModule
from gpipe_lab.data.translation_datamodule import SyntheticTranslationDataModule


def _cifar(variant: int) -> Callable[..., pl.LightningDataModule]:
    def build(**kwargs: object) -> CIFARDataModule:
        return CIFARDataModule(variant=variant, **kwargs)

    build.__signature__ = inspect.signature(CIFARDataModule)  # type: ignore[attr-defined]
    return build


DATAMODULES: dict[str, Callable[..., pl.LightningDataModule]] = {
    "synthetic_images": SyntheticImageDataModule,
    "synthetic_translation": SyntheticTranslationDataModule,
    "cifar10": _cifar(10),
    "cifar100": _cifar(100),
    "imagenet": ImageNetDataModule,
    "parallel_text": ParallelTextDataModule,
}


def build_datamodule(name: str = "synthetic_images", **kwargs: object) -> pl.LightningDataModule:
    """Construct the datamodule registered as ``name`` with ``kwargs``.

    Raises:
        ValueError: for an unknown ``name`` (the message lists the known ones) or a bad value
            (the message names the key and its allowed range).
        TypeError: for an argument the datamodule does not take (the message lists those it takes).
        FileNotFoundError: for a real dataset whose files are missing.
    """
    if name not in DATAMODULES:
        raise ValueError(f"name must be one of {sorted(DATAMODULES)}, got {name!r}")
    factory = DATAMODULES[name]
    accepted = [p for p in inspect.signature(factory).parameters if not (name.startswith("cifar") and p == "variant")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"datamodule {name!r} got unexpected argument(s) {unknown}; it accepts {accepted}")
    return factory(**kwargs)

"""``build_datamodule(name, **kwargs)``: every datamodule by name, for the Hydra app."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import cast

import lightning.pytorch as pl

from gpipe_lab.data.image_datamodule import SyntheticImageDataModule
from gpipe_lab.data.parallel_text import ParallelTextDataModule
from gpipe_lab.data.real_images import CIFARDataModule, ImageNetDataModule
from gpipe_lab.data.translation_datamodule import SyntheticTranslationDataModule

DATAMODULES: dict[str, Callable[..., pl.LightningDataModule]] = {
    "synthetic_images": SyntheticImageDataModule,
    "synthetic_translation": SyntheticTranslationDataModule,
    "cifar10": partial(CIFARDataModule, variant=10),
    "cifar100": partial(CIFARDataModule, variant=100),
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
    accepted = accepted_arguments(name)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"datamodule {name!r} got unexpected argument(s) {unknown}; it accepts {accepted}")
    return DATAMODULES[name](**kwargs)


def accepted_arguments(name: str) -> list[str]:
    """The keyword arguments datamodule ``name`` takes: its own, those it passes to its dataset
    (``dataset_arguments``), then its base loader's (the ``**loader`` a subclass passes on),
    without those its registry entry fixes (CIFAR's ``variant``).

    Raises:
        KeyError: ``name`` is not registered.
    """
    factory = DATAMODULES[name]
    fixed = factory.keywords if isinstance(factory, partial) else {}
    cls = cast(type, factory.func if isinstance(factory, partial) else factory)  # each entry: a class or its partial
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        names += [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                  and p.name not in names and p.name not in fixed]
        names += [n for n in getattr(klass, "dataset_arguments", ()) if n not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names

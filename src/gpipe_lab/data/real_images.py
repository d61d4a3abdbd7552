"""Real image datasets from local files: CIFAR-10/100 (torchvision format) and ImageNet (ImageFolder).

Nothing is downloaded unless ``download=True`` (CIFAR only, for machines with internet).
A missing dataset raises ``FileNotFoundError`` in the constructor, naming the path and the
Hydra override that provides it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchvision import datasets

from gpipe_lab.data.checks import DataNotFoundError, check_positive_int, require_path
from gpipe_lab.data.image_datamodule import ImageDataModule
from gpipe_lab.data.image_transforms import cifar_transform, imagenet_transform

_CIFAR = {
    10: (datasets.CIFAR10, 10),
    100: (datasets.CIFAR100, 100),
}


def _check_num_classes(requested: int | None, actual: int, source: str) -> None:
    if requested is not None and requested != actual:
        raise ValueError(f"num_classes must be {actual} for {source} (or left unset), got {requested!r}")


class CIFARDataModule(ImageDataModule):
    """CIFAR-10 or CIFAR-100 from ``root`` in torchvision's on-disk layout
    (``root/cifar-10-batches-py/...`` or ``root/cifar-100-python/...``).

    Args:
        root: folder holding the extracted archive.
        variant: 10 or 100.
        download: fetch the archive in ``prepare_data`` (needs internet; default False).
        image_size: 32, or larger to resize for a paper-size model (e.g. 224).
        random_crop / random_flip: padded random crop and horizontal flip for training.
        cutout: side of the cutout square in pixels (0 disables it).
        Other arguments: see ``ImageDataModule``.

    Raises:
        ValueError: if ``variant`` is not 10 or 100, ``num_classes`` is given and differs from it,
            or a size is out of range.
        DataNotFoundError: (a ``FileNotFoundError``) if ``download`` is False and a data file is
            missing under ``root``; in ``setup``, if a file fails torchvision's checksum.
    """

    def __init__(
        self,
        root: str | Path,
        variant: int = 10,
        download: bool = False,
        batch_size: int = 128,
        image_size: int = 32,
        random_crop: bool = True,
        random_flip: bool = True,
        cutout: int = 0,
        num_classes: int | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **loader)
        if variant not in _CIFAR:
            raise ValueError(f"variant must be 10 or 100, got {variant!r}")
        self.dataset_cls, self.num_classes = _CIFAR[variant]
        _check_num_classes(num_classes, self.num_classes, f"CIFAR-{variant}")
        self.root, self.download = Path(root).expanduser(), bool(download)
        self.image_size = check_positive_int("image_size", image_size, minimum=8)
        self.cutout = check_positive_int("cutout", cutout, minimum=0)
        self.random_crop, self.random_flip = bool(random_crop), bool(random_flip)
        if not self.download:
            folder = self.root / self.dataset_cls.base_folder
            hint = f"Set data.root to the folder that holds '{self.dataset_cls.base_folder}', or data.download=true on a machine with internet (fetches it)."
            for name, _md5 in self.dataset_cls.train_list + self.dataset_cls.test_list:
                require_path(folder / name, f"CIFAR-{variant} file", hint)

    def prepare_data(self) -> None:
        if self.download:
            self.dataset_cls(str(self.root), train=True, download=True)
            self.dataset_cls(str(self.root), train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        kw: dict[str, Any] = dict(image_size=self.image_size, random_flip=self.random_flip)
        try:
            self.train_set = self.dataset_cls(
                str(self.root), train=True, transform=cifar_transform(True, random_crop=self.random_crop, cutout=self.cutout, **kw)
            )
            self.val_set = self.dataset_cls(str(self.root), train=False, transform=cifar_transform(False, **kw))
        except RuntimeError as exc:  # torchvision's "Dataset not found or corrupted": a file failed its md5
            folder = self.root / self.dataset_cls.base_folder
            raise DataNotFoundError(
                f"CIFAR files in '{folder}' fail torchvision's checksum (a partial or different copy); "
                f"replace them with the files of the official archive, or data.download=true on a machine with internet (fetches it)."
            ) from exc


class ImageNetDataModule(ImageDataModule):
    """ImageNet (or any dataset) in ImageFolder layout: ``root/train/<class>/*`` and ``root/val/<class>/*``.

    Train transform: RandomResizedCrop(image_size), optional horizontal flip and cutout;
    validation: Resize(image_size * 256 / 224) + CenterCrop(image_size). ``num_classes`` is the
    number of class folders under ``root/train``.

    Raises:
        FileNotFoundError: if ``root/train`` or ``root/val`` is missing.
        ValueError: if a size is out of range, the split has no class folder, the two splits
            disagree on the class names, or ``num_classes`` is given and differs from the folders.
    """

    def __init__(
        self,
        root: str | Path,
        batch_size: int = 64,
        image_size: int = 224,
        random_flip: bool = True,
        cutout: int = 0,
        num_classes: int | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **loader)
        self.root = Path(root).expanduser()
        self.image_size = check_positive_int("image_size", image_size, minimum=8)
        self.cutout = check_positive_int("cutout", cutout, minimum=0)
        self.random_flip = bool(random_flip)
        hint = "Set data.root to a folder with train/<class>/*.jpg and val/<class>/*.jpg (ImageFolder layout)."
        classes = [self._classes(require_path(self.root / split, f"ImageNet {split} split", hint)) for split in ("train", "val")]
        if classes[0] != classes[1]:
            raise ValueError(f"class folders differ between {self.root / 'train'} and {self.root / 'val'}")
        self.classes = classes[0]
        self.num_classes = len(self.classes)
        _check_num_classes(num_classes, self.num_classes, str(self.root / "train"))

    @staticmethod
    def _classes(split_dir: Path) -> list[str]:
        names = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
        if not names:
            raise ValueError(f"no class folder found in {split_dir}")
        return names

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.train_set = datasets.ImageFolder(
            str(self.root / "train"), transform=imagenet_transform(True, self.image_size, self.random_flip, self.cutout)
        )
        self.val_set = datasets.ImageFolder(str(self.root / "val"), transform=imagenet_transform(False, self.image_size))

"""Real image loaders on small generated files: ImageFolder PNGs, a fake CIFAR-10, missing paths."""

import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets
from torchvision.datasets import cifar as cifar_module

from gpipe_lab.data import CIFARDataModule, Cutout, ImageNetDataModule, build_datamodule


def _image_folder(root, classes=("cat", "dog"), per_class=3):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (40 + 4 * i, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")
    return root


def test_image_folder_loads_with_standard_transforms(tmp_path):
    dm = build_datamodule("imagenet", root=str(_image_folder(tmp_path)), batch_size=2, image_size=32, cutout=8)
    assert dm.num_classes == 2 and dm.classes == ["cat", "dog"]
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 32, 32) and y.shape == (2,)
    xv, yv = next(iter(dm.val_dataloader()))
    assert xv.shape == (2, 3, 32, 32) and yv.tolist() == [0, 0]
    assert "RandomResizedCrop" in repr(dm.train_set.transform) and "Cutout" in repr(dm.train_set.transform)
    assert "CenterCrop" in repr(dm.val_set.transform)


def test_image_folder_missing_split_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train.*data\.root"):
        ImageNetDataModule(tmp_path / "nowhere")
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="val"):
        ImageNetDataModule(tmp_path)


def test_image_folder_num_classes_must_match(tmp_path):
    with pytest.raises(ValueError, match="num_classes"):
        ImageNetDataModule(_image_folder(tmp_path), num_classes=1000)


def _fake_cifar10(root, n=8):
    folder = root / datasets.CIFAR10.base_folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, _ in datasets.CIFAR10.train_list + datasets.CIFAR10.test_list:
        entry = {"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), "labels": [i % 10 for i in range(n)]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
    with open(folder / datasets.CIFAR10.meta["filename"], "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    return root


def test_fake_cifar10_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar_module, "check_integrity", lambda *args, **kwargs: True)  # our files have other md5s
    dm = build_datamodule("cifar10", root=str(_fake_cifar10(tmp_path)), batch_size=4, cutout=8, seed=0)
    assert dm.num_classes == 10
    dm.setup("fit")
    assert len(dm.train_set) == 40 and len(dm.val_set) == 8
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and y.dtype == torch.long
    big = CIFARDataModule(tmp_path, batch_size=2, image_size=64)
    big.setup("fit")
    assert next(iter(big.val_dataloader()))[0].shape == (2, 3, 64, 64)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_missing_cifar_fails_at_construction(tmp_path, name):
    with pytest.raises(FileNotFoundError, match=r"data\.root.*data\.download=true"):
        build_datamodule(name, root=str(tmp_path))
    with pytest.raises(ValueError, match="num_classes"):
        build_datamodule("cifar10", root=str(tmp_path), num_classes=100)


def test_cutout_zeroes_one_square():
    torch.manual_seed(0)
    out = Cutout(4)(torch.ones(3, 16, 16))
    zeros = (out == 0).all(0)
    assert 4 <= int(zeros.sum()) <= 16 and out.shape == (3, 16, 16)
    with pytest.raises(ValueError, match="cutout"):
        Cutout(0)

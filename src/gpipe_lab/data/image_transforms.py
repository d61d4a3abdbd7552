"""Image transforms: the standard ImageNet/CIFAR pipelines, plus cutout (as in GPipe's fine-tuning)."""

from __future__ import annotations

import torch
from torchvision import transforms as T

from gpipe_lab.data.checks import check_positive_int

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class Cutout:
    """Zero one random ``size`` x ``size`` square of a ``[C, H, W]`` tensor (DeVries & Taylor, 2017).

    The square's centre is uniform over the image, so it may be clipped at the border.

    Raises:
        ValueError: if ``size < 1``.
    """

    def __init__(self, size: int) -> None:
        self.size = check_positive_int("cutout", size)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        cy, cx = int(torch.randint(h, (1,))), int(torch.randint(w, (1,)))
        y0, y1 = max(0, cy - self.size // 2), min(h, cy + (self.size + 1) // 2)
        x0, x1 = max(0, cx - self.size // 2), min(w, cx + (self.size + 1) // 2)
        img = img.clone()
        img[..., y0:y1, x0:x1] = 0
        return img

    def __repr__(self) -> str:
        return f"Cutout(size={self.size})"


def _augment_tail(mean: tuple[float, ...], std: tuple[float, ...], cutout: int) -> list[object]:
    tail: list[object] = [T.ToTensor(), T.Normalize(mean, std)]
    if cutout > 0:
        tail.append(Cutout(cutout))
    return tail


def imagenet_transform(train: bool, image_size: int = 224, random_flip: bool = True, cutout: int = 0) -> T.Compose:
    """Train: RandomResizedCrop(+flip)(+cutout); val: Resize(size*256/224) + CenterCrop(size)."""
    if not train:
        return T.Compose(
            [T.Resize(round(image_size * 256 / 224)), T.CenterCrop(image_size), T.ToTensor(),
             T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        )
    ops: list[object] = [T.RandomResizedCrop(image_size)]
    if random_flip:
        ops.append(T.RandomHorizontalFlip())
    return T.Compose(ops + _augment_tail(IMAGENET_MEAN, IMAGENET_STD, cutout))


def cifar_transform(
    train: bool, image_size: int = 32, random_crop: bool = True, random_flip: bool = True, cutout: int = 0
) -> T.Compose:
    """CIFAR pipeline: optional resize (e.g. to 224 for fine-tuning a paper-size model), then for
    training a padded random crop, horizontal flip and cutout, each optional."""
    ops: list[object] = [] if image_size == 32 else [T.Resize(image_size)]
    if train:
        if random_crop:
            ops.append(T.RandomCrop(image_size, padding=image_size // 8))
        if random_flip:
            ops.append(T.RandomHorizontalFlip())
        return T.Compose(ops + _augment_tail(CIFAR_MEAN, CIFAR_STD, cutout))
    return T.Compose(ops + [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])

"""Procedurally generated image classification: the class is visible in the pixels.

Every class is a *prototype*: a shape (disk, square, triangle, ring, cross,
diamond), a foreground and a background colour, and a stripe texture (angle and
frequency) drawn inside the shape. Each sample jitters the prototype: position,
size, colours, stripe phase and angle, plus pixel noise. Prototypes come from
``(class_seed, class_offset + label)``, samples from ``(seed, split, index)``, so

- the same arguments give bit-identical images, a different ``seed`` gives
  different images of the same classes;
- ``class_offset`` selects a disjoint *class set*: pretrain on offset 0 and
  fine-tune on offset 1000, and the two tasks share no prototype.
"""

from __future__ import annotations

import math
from typing import TypedDict

import torch
from torch.utils.data import Dataset

from gpipe_lab.data.checks import check_fraction, check_positive_int

NUM_SHAPES = 6
#: ``render_all`` keeps a split's images only up to this many bytes (the default task: 24 MB).
CACHE_LIMIT_BYTES = 256 << 20
_MASK64 = (1 << 63) - 1


def mix_seed(*parts: int) -> int:
    """Hash integers into one 63-bit generator seed (splitmix64-style, deterministic)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK64


def _signed_distance(shape: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Positive inside the unit-size shape, negative outside (units of the shape radius)."""
    ax, ay = x.abs(), y.abs()
    if shape == 0:  # disk
        return 1 - torch.sqrt(x * x + y * y)
    if shape == 1:  # square
        return 0.85 - torch.maximum(ax, ay)
    if shape == 2:  # triangle pointing up (y grows downwards)
        return torch.minimum(0.7 - y, 0.65 * (y + 1) - ax)
    if shape == 3:  # ring
        return 0.28 - (torch.sqrt(x * x + y * y) - 0.68).abs()
    if shape == 4:  # cross
        return torch.maximum(torch.minimum(0.3 - ax, 1 - ay), torch.minimum(0.3 - ay, 1 - ax))
    return 1.1 - (ax + ay)  # diamond


class _Prototype(TypedDict):
    """One class's look: shape index, foreground and background colours, stripe angle and frequency."""

    shape: int
    fg: torch.Tensor
    bg: torch.Tensor
    angle: float
    freq: float


class SyntheticImageDataset(Dataset):
    """``num_samples`` images ``[3, image_size, image_size]`` (float32, roughly zero mean) with labels.

    Args:
        num_samples: dataset length.
        num_classes: number of classes; label of sample ``i`` is ``i % num_classes``.
        image_size: height and width in pixels (>= 8).
        seed: sample seed; ``split`` separates train from validation draws.
        class_offset: first prototype id; disjoint offsets give disjoint class sets.
        class_seed: seed of the prototype table.
        noise: standard deviation of the additive pixel noise (in [0, 1]).
        split: any integer; train and validation use different values.

    Raises:
        ValueError: for non-positive sizes, ``image_size < 8``, negative ``class_offset`` or
            ``noise`` outside [0, 1].
    """

    def __init__(
        self,
        num_samples: int,
        num_classes: int = 10,
        image_size: int = 32,
        seed: int = 0,
        class_offset: int = 0,
        class_seed: int = 1234,
        noise: float = 0.1,
        split: int = 0,
    ) -> None:
        self.num_samples = check_positive_int("num_samples", num_samples)
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.image_size = check_positive_int("image_size", image_size, minimum=8)
        self.class_offset = check_positive_int("class_offset", class_offset, minimum=0)
        self.noise = check_fraction("noise", noise)
        self.seed, self.class_seed, self.split = int(seed), int(class_seed), int(split)
        self.prototypes = [self._prototype(self.class_offset + c) for c in range(self.num_classes)]
        coords = (torch.arange(self.image_size, dtype=torch.float32) + 0.5) / self.image_size * 2 - 1
        self._gy, self._gx = torch.meshgrid(coords, coords, indexing="ij")
        self._images: torch.Tensor | None = None

    def render_all(self, limit_bytes: int = CACHE_LIMIT_BYTES) -> bool:
        """Draw every image once and keep them, so reading a batch costs no drawing.

        Returns whether they were kept: not when the split needs more than ``limit_bytes``
        (each image is then drawn when read, as without this call).
        """
        if self._images is None and self.num_samples * 3 * self.image_size**2 * 4 <= limit_bytes:
            self._images = torch.stack([self.render(i % self.num_classes, i) for i in range(self.num_samples)])
        return self._images is not None

    def _prototype(self, proto_id: int) -> _Prototype:
        g = torch.Generator().manual_seed(mix_seed(self.class_seed, proto_id, 7))
        fg = torch.rand(3, generator=g) * 0.8 + 0.1
        bg = torch.rand(3, generator=g) * 0.8 + 0.1
        while (fg - bg).abs().sum() < 0.6:  # keep the shape visible against its background
            bg = torch.rand(3, generator=g) * 0.8 + 0.1
        return {
            "shape": proto_id % NUM_SHAPES if proto_id < NUM_SHAPES else int(torch.randint(NUM_SHAPES, (1,), generator=g)),
            "fg": fg,
            "bg": bg,
            "angle": float(torch.rand(1, generator=g)) * math.pi,
            "freq": 1.5 + 2.5 * float(torch.rand(1, generator=g)),
        }

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(image [3,H,W] float32, label [] long)``.

        Raises:
            IndexError: if ``index`` is outside ``[0, len(self))``.
        """
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        label = index % self.num_classes
        image = self._images[index] if self._images is not None else self.render(label, index)
        return image, torch.tensor(label, dtype=torch.long)

    def render(self, label: int, index: int) -> torch.Tensor:
        """Draw sample ``index`` of class ``label`` (deterministic in both and in the seeds)."""
        p = self.prototypes[label]
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.split, index, 11))
        u = torch.rand(10, generator=g)
        cx, cy = (u[0] - 0.5) * 0.5, (u[1] - 0.5) * 0.5
        radius = 0.45 + 0.25 * float(u[2])
        angle = p["angle"] + (float(u[3]) - 0.5) * 0.3
        phase = float(u[4]) * 2 * math.pi
        fg = (p["fg"] + torch.randn(3, generator=g) * 0.05).clamp(0, 1)
        bg = (p["bg"] + torch.randn(3, generator=g) * 0.05).clamp(0, 1)
        x, y = (self._gx - cx) / radius, (self._gy - cy) / radius
        dist = _signed_distance(int(p["shape"]), x, y)
        mask = torch.sigmoid(dist * radius * self.image_size)  # about one pixel of anti-aliasing
        t = self._gx * math.cos(angle) + self._gy * math.sin(angle)
        stripes = 0.65 + 0.35 * torch.sin(math.pi * p["freq"] * t + phase)
        shade = 0.9 + 0.2 * (float(u[5]) * self._gx + float(u[6]) * self._gy)  # soft lighting gradient
        img = mask * fg[:, None, None] * stripes + (1 - mask) * bg[:, None, None] * shade
        if self.noise > 0:
            img = img + torch.randn(img.shape, generator=g) * self.noise
        return ((img.clamp(0, 1) - 0.5) / 0.25).to(torch.float32)

"""Image datamodules: the shared loader logic and the built-in synthetic task.

Batches are ``(images [B, 3, H, W] float32, labels [B] long)``.

Data parallelism: pass ``data_parallel_rank`` / ``data_parallel_size``; with a size above
one each replica reads its own shard through a ``DistributedSampler`` (Lightning leaves a
loader that already has one untouched). With the default size 1 the loaders use plain
samplers, which Lightning replaces by its own ``DistributedSampler`` when the strategy is
distributed and ``use_distributed_sampler=True``; both ways work for images.

The training loader is a ``ResumableDataLoader``: a checkpoint taken mid-epoch resumes at
the exact next batch (its order depends only on (seed, epoch)).
"""

from __future__ import annotations

import inspect
from collections.abc import Sized
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler

from gpipe_lab.data.checks import check_positive_int, check_replica
from gpipe_lab.data.resumable import ResumableDataLoader
from gpipe_lab.data.synthetic_images import SyntheticImageDataset


class Augmented(Dataset):
    """``dataset``'s images with a random horizontal flip (p=0.5) and a cutout square, drawn from
    torch's global generator like torchvision's transforms (seeded by the run, saved in checkpoints)."""

    def __init__(self, dataset: Dataset, random_flip: bool, cutout: int) -> None:
        from gpipe_lab.data.image_transforms import Cutout

        self.dataset, self.random_flip = dataset, bool(random_flip)
        self.cut = Cutout(cutout) if cutout else None

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # a map-style dataset (torch's Dataset declares no __len__)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.dataset[index]
        if self.random_flip and float(torch.rand(1)) < 0.5:
            image = image.flip(-1)
        return (self.cut(image) if self.cut is not None else image), label


class EpochRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on (seed, epoch), not on how many epochs
    this loader already ran: Lightning calls ``set_epoch``, so a run resumed from a checkpoint
    reads the same batches as an uninterrupted one. (Still a ``RandomSampler``, so a distributed
    Trainer replaces it by a shuffling ``DistributedSampler`` as before.)"""

    def __init__(self, data_source: Dataset, seed: int = 0) -> None:
        super().__init__(cast(Sized, data_source))  # (as above: it has a length)
        self.seed, self.epoch = int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):  # noqa: ANN204 - same as RandomSampler.__iter__
        # a generator of its own per iterator, drawn now: iterators that overlap cannot disturb each other
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=g).tolist())


class ImageDataModule(pl.LightningDataModule):
    """Loader logic shared by every image datamodule; subclasses fill ``train_set`` / ``val_set``
    and, when the data has one, ``test_set`` (``has_test_set``).

    Raises:
        ValueError: if ``batch_size < 1``, ``num_workers < 0`` or the replica is out of range.
    """

    num_classes: int

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        drop_last: bool = True,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
    ) -> None:
        super().__init__()
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.num_workers = check_positive_int("num_workers", num_workers, minimum=0)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.data_parallel_rank, self.data_parallel_size = check_replica(data_parallel_rank, data_parallel_size)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    @property
    def has_test_set(self) -> bool:
        """Whether the data has a test split (``test_dataloader`` reads it)."""
        return self.test_set is not None

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            self.setup("fit")
            dataset = cast(Dataset, self.train_set if train else self.val_set)  # both made by setup
        if self.data_parallel_size > 1:
            sampler: torch.utils.data.Sampler = DistributedSampler(
                dataset, num_replicas=self.data_parallel_size, rank=self.data_parallel_rank,
                shuffle=train, seed=self.seed, drop_last=train and self.drop_last,
            )
        elif train:
            sampler = EpochRandomSampler(dataset, seed=self.seed)
        else:
            sampler = SequentialSampler(cast(Sized, dataset))
        loader = (ResumableDataLoader if train else DataLoader)(
            dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
            drop_last=train and self.drop_last, persistent_workers=self.num_workers > 0,
        )
        if train:
            loader.seed = self.seed
        else:  # its iterators' worker seed from here, not from the global RNG (see data.resumable)
            loader.generator = torch.Generator().manual_seed(self.seed)
        return loader

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        """The test split's loader (in order, like validation's).

        Raises:
            RuntimeError: the data has no test split (``has_test_set`` is false).
        """
        if self.test_set is None:
            raise RuntimeError(f"{type(self).__name__} has no test split")
        return self._loader(self.test_set, train=False)


class SyntheticImageDataModule(ImageDataModule):
    """The built-in synthetic classification task (see ``synthetic_images``); needs no files.

    Args:
        num_train / num_val / num_test: sample counts; the splits never share a sample
            (``num_test=0``: no test split).
        random_flip / cutout: training-set augmentation (see ``Augmented``); off by default.
        Other arguments: the images' (``image_size``, ``num_classes``, ``class_offset``,
            ``class_seed``, ``noise``: see ``SyntheticImageDataset``; both splits share them and
            ``seed``), else the loader's (see ``ImageDataModule``).

    Raises:
        ValueError: for non-positive sizes or counts (message names the key and range).
    """

    #: keyword arguments passed on to both splits' ``SyntheticImageDataset``
    dataset_arguments = tuple(p for p in inspect.signature(SyntheticImageDataset).parameters
                              if p not in ("num_samples", "seed", "split"))

    def __init__(self, batch_size: int = 32, num_train: int = 5000, num_val: int = 1000, num_test: int = 1000,
                 random_flip: bool = False, cutout: int = 0, **options: Any) -> None:
        images = {k: options.pop(k) for k in self.dataset_arguments if k in options}
        super().__init__(batch_size=batch_size, **options)
        check_positive_int("num_train", num_train)
        check_positive_int("num_val", num_val)
        check_positive_int("num_test", num_test, minimum=0)
        common = dict(images, seed=self.seed)
        self.train_set = SyntheticImageDataset(num_train, split=0, **common)
        self.val_set = SyntheticImageDataset(num_val, split=1, **common)
        self.test_set = SyntheticImageDataset(num_test, split=2, **common) if num_test else None
        self.num_classes = self.train_set.num_classes
        self.image_size = self.train_set.image_size
        check_positive_int("cutout", cutout, minimum=0)
        if random_flip or cutout:
            self.train_set = Augmented(self.train_set, random_flip, cutout)

    def setup(self, stage: str) -> None:
        """Draw each split's images once, in this process, before any loader reads them (drawing
        them batch by batch in the training loop's process costs about half a small model's step)."""
        for data in (self.train_set, self.val_set, self.test_set):
            base = data.dataset if isinstance(data, Augmented) else data
            if isinstance(base, SyntheticImageDataset):
                base.render_all()

"""Translation datamodules: shared loader logic and the built-in synthetic language pair.

Batches are ``((src [B, S], tgt_in [B, T]), tgt_out [B, T])`` (see ``token_batching``).

Data parallelism: token-bucket batch samplers shard themselves. Pass
``data_parallel_rank`` / ``data_parallel_size``; if they are left at None, the loaders read
them from ``trainer.distributed_sampler_kwargs`` (``num_replicas``, ``rank``) when a trainer
is attached, else use one replica. A distributed Trainer with the default
``use_distributed_sampler=True`` re-creates the batch sampler around its own
``DistributedSampler``; the sampler then takes the replica from it (see
``TokenBucketBatchSampler``), so both settings shard the same way.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from gpipe_lab.data.checks import check_positive_int, check_replica
from gpipe_lab.data.resumable import ResumableDataLoader
from gpipe_lab.data.synthetic_images import mix_seed
from gpipe_lab.data.synthetic_language import SyntheticLanguagePair
from gpipe_lab.data.token_batching import TokenBucketBatchSampler, TranslationDataset, collate_translation
from gpipe_lab.data.vocabulary import BOS_ID, EOS_ID, PAD_ID, UNK_ID


class TranslationDataModule(pl.LightningDataModule):
    """Loader logic shared by the translation datamodules.

    Subclasses set ``train_set`` / ``val_set`` (``TranslationDataset``), ``val_references``
    (detokenized target strings in ``val_set`` order), ``vocab_size`` and ``decode``; and for a
    test split (``has_test_set``) ``test_set`` and ``test_references``.

    Raises:
        ValueError: if both ``tokens_per_batch`` and ``batch_size`` are None, either is below 1,
            ``num_workers < 0``, or the replica is out of range.
    """

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID
    vocab_size: int

    def __init__(
        self,
        tokens_per_batch: int | None = 4096,
        batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        data_parallel_rank: int | None = None,
        data_parallel_size: int | None = None,
    ) -> None:
        super().__init__()
        if tokens_per_batch is None and batch_size is None:
            raise ValueError("give tokens_per_batch (>= 1) or batch_size (>= 1) for translation batches")
        self.tokens_per_batch = None if tokens_per_batch is None else check_positive_int("tokens_per_batch", tokens_per_batch)
        self.batch_size = None if batch_size is None else check_positive_int("batch_size", batch_size)
        self.num_workers = check_positive_int("num_workers", num_workers, minimum=0)
        self.seed = int(seed)
        if data_parallel_size is not None or data_parallel_rank is not None:
            check_replica(data_parallel_rank or 0, data_parallel_size or 1)
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.train_set: TranslationDataset | None = None
        self.val_set: TranslationDataset | None = None
        self.test_set: TranslationDataset | None = None
        self.val_references: list[str] = []
        self.test_references: list[str] = []

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text of ``ids`` (stops at EOS, skips PAD/BOS)."""
        raise NotImplementedError

    @property
    def has_test_set(self) -> bool:
        """Whether the data has a test split (``test_dataloader`` reads it)."""
        self.setup("test")
        return self.test_set is not None

    def _test_set(self) -> TranslationDataset:
        if not self.has_test_set:
            raise RuntimeError(f"{type(self).__name__} has no test split")
        assert self.test_set is not None
        return self.test_set

    def _replica(self) -> tuple[int, int]:
        if self.data_parallel_size is not None or self.data_parallel_rank is not None:
            return self.data_parallel_rank or 0, self.data_parallel_size or 1
        trainer = getattr(self, "trainer", None)
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
        if kwargs:
            return check_replica(int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1)))
        return 0, 1

    def batch_sampler(self, dataset: TranslationDataset, train: bool) -> TokenBucketBatchSampler:
        """The token-bucket sampler this module uses for ``dataset`` (validation: no shuffle, no repeats)."""
        rank, size = self._replica()
        return TokenBucketBatchSampler(
            dataset.sizes, self.tokens_per_batch, self.batch_size, shuffle=train, seed=self.seed,
            rank=rank, world_size=size, pad_shards=train,
        )

    def _loader(self, dataset: TranslationDataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        loader = (ResumableDataLoader if train else DataLoader)(
            dataset, batch_sampler=self.batch_sampler(dataset, train), collate_fn=collate_translation,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )
        if train:  # resumable mid-epoch (see gpipe_lab.data.resumable)
            loader.seed = self.seed
        else:  # its iterators' worker seed from here, not from the global RNG
            loader.generator = torch.Generator().manual_seed(self.seed)
        return loader

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        """The test split's loader.

        Raises:
            RuntimeError: the data has no test split (``has_test_set`` is false).
        """
        return self._loader(self._test_set(), train=False)

    def batch_indices(self, split: str = "val") -> list[list[int]]:
        """This replica's batches of ``split`` ("val" or "test") as dataset indices, in the order its
        dataloader yields them: ``[references[i] for i in indices]`` are one batch's references.

        Raises:
            ValueError: if ``split`` is not "val" or "test".
            RuntimeError: ``split`` is "test" and the data has no test split.
        """
        if split not in ("val", "test"):
            raise ValueError(f"split must be 'val' or 'test', got {split!r}")
        self.setup("fit")
        dataset = self._test_set() if split == "test" else cast(TranslationDataset, self.val_set)  # made by setup
        return list(self.batch_sampler(dataset, train=False))

    def batch_references(self, split: str = "val") -> list[list[str]]:
        """Reference strings per batch of ``split``, aligned with ``val_dataloader`` / ``test_dataloader``."""
        refs = self.test_references if split == "test" else self.val_references
        return [[refs[i] for i in batch] for batch in self.batch_indices(split)]


class SyntheticTranslationDataModule(TranslationDataModule):
    """The built-in synthetic language pair (see ``synthetic_language``); needs no files.

    Args:
        num_train / num_val / num_test: pair counts (validation and test never repeat a training or
            each other's source sentence; ``num_test=0``: no test split).
        language_seed: seed of the vocabularies and grammar; ``seed`` draws the sentences.
        min_len / max_len: source sentence length range in words (3–12 by default).
        Other arguments: see ``TranslationDataModule``.

    Raises:
        ValueError: for non-positive counts or an impossible length range.
    """

    def __init__(self, tokens_per_batch: int | None = 2048, num_train: int = 10000, num_val: int = 500,
                 num_test: int = 500, language_seed: int = 0, min_len: int = 3, max_len: int = 12,
                 **loader: Any) -> None:
        super().__init__(tokens_per_batch=tokens_per_batch, **loader)
        check_positive_int("num_train", num_train)
        check_positive_int("num_val", num_val)
        check_positive_int("num_test", num_test, minimum=0)
        if not 3 <= min_len <= max_len:
            raise ValueError(f"need 3 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        self.language = SyntheticLanguagePair(language_seed)
        self.vocab = self.language.vocab
        self.vocab_size = len(self.vocab)
        rng = random.Random(mix_seed(self.seed, language_seed, 3))
        train = [self.language.sample(rng, min_len, max_len) for _ in range(num_train)]
        seen = {tuple(s) for s, _ in train}
        # the test pairs are drawn after the validation pairs: train and validation stay as without them
        val, test = (self._unseen(rng, count, seen, min_len, max_len) for count in (num_val, num_test))
        self.train_pairs, self.val_pairs, self.test_pairs = train, val, test
        self.train_set = self._encode(train)
        self.val_set = self._encode(val)
        self.val_references = [" ".join(t) for _, t in val]
        if test:
            self.test_set = self._encode(test)
            self.test_references = [" ".join(t) for _, t in test]

    def _unseen(self, rng: random.Random, count: int, seen: set[tuple[str, ...]], min_len: int,
                max_len: int) -> list[tuple[list[str], list[str]]]:
        """Up to ``count`` pairs whose source sentence is not in ``seen`` (added to it)."""
        pairs: list[tuple[list[str], list[str]]] = []
        for _ in range(100 * count):
            if len(pairs) == count:
                break
            s, t = self.language.sample(rng, min_len, max_len)
            if tuple(s) not in seen:
                seen.add(tuple(s))
                pairs.append((s, t))
        return pairs

    def _encode(self, pairs: Sequence[tuple[list[str], list[str]]]) -> TranslationDataset:
        return TranslationDataset([(self.vocab.encode(s), self.vocab.encode(t)) for s, t in pairs])

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text of ``ids`` (stops at EOS, skips PAD/BOS)."""
        return self.vocab.decode(ids)

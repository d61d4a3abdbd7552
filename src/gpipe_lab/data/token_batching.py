"""Translation batches: a dataset of id pairs, the padded collate, and token-budget buckets.

A batch is ``((src [B, S], tgt_in [B, T]), tgt_out [B, T])`` (long tensors, padded with
``PAD_ID``): ``src`` is the source ids + EOS, ``tgt_in`` is BOS + target ids and
``tgt_out`` is target ids + EOS. The padded cost of a batch of ``B`` pairs is
``B * max(S, T)``; ``TokenBucketBatchSampler`` keeps it within ``tokens_per_batch``
unless a single pair exceeds the budget (it then goes alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, Sampler

from gpipe_lab.data.checks import check_positive_int, check_replica
from gpipe_lab.data.vocabulary import BOS_ID, EOS_ID, PAD_ID

Pair = tuple[torch.Tensor, torch.Tensor]
Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


class TranslationDataset(Dataset):
    """Pairs of id lists (without BOS/EOS). ``sizes[i]`` is the padded length pair ``i`` needs."""

    def __init__(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        self.pairs = [(torch.tensor(s, dtype=torch.long), torch.tensor(t, dtype=torch.long)) for s, t in pairs]
        self.sizes = [max(len(s), len(t)) + 1 for s, t in pairs]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> Pair:
        return self.pairs[index]


def _pad(seqs: Sequence[torch.Tensor], prefix: int | None, suffix: int | None) -> torch.Tensor:
    length = max(len(s) for s in seqs) + (prefix is not None) + (suffix is not None)
    out = torch.full((len(seqs), length), PAD_ID, dtype=torch.long)
    for row, s in enumerate(seqs):
        parts = ([torch.tensor([prefix])] if prefix is not None else []) + [s]
        parts += [torch.tensor([suffix])] if suffix is not None else []
        seq = torch.cat(parts)
        out[row, : len(seq)] = seq
    return out


def collate_translation(pairs: Sequence[Pair]) -> Batch:
    """Pad a list of ``(src_ids, tgt_ids)`` into ``((src, tgt_in), tgt_out)``."""
    src = _pad([s for s, _ in pairs], None, EOS_ID)
    tgt_in = _pad([t for _, t in pairs], BOS_ID, None)
    tgt_out = _pad([t for _, t in pairs], None, EOS_ID)
    return (src, tgt_in), tgt_out


class TokenBucketBatchSampler(BatchSampler):
    """Batches of pairs of similar length within a padded-token budget, sharded by replica.

    Pairs are sorted by size (ties broken at random per epoch when shuffling), cut greedily
    into batches whose ``count * max size`` stays within ``tokens_per_batch`` and whose count
    stays within ``max_sentences``; the batch order is then shuffled. Replica ``rank`` of
    ``world_size`` takes every ``world_size``-th batch. With ``pad_shards`` (training) the
    batch list is first padded by repeating batches from the start so every replica gets the
    same number of steps; without it (validation) nothing is repeated.

    Lightning compatibility: when a distributed Trainer injects a ``DistributedSampler`` (it
    re-creates batch samplers with a new ``sampler`` argument), the replica is taken from that
    sampler's ``rank`` / ``num_replicas``; its order is not used.

    Call ``set_epoch`` (Lightning does, through ``.sampler``) for a new order each epoch; the same
    ``(seed, epoch)`` always gives the same batches.

    Raises:
        ValueError: if neither limit is given, a limit is below 1, or the replica is invalid.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        tokens_per_batch: int | None = None,
        max_sentences: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad_shards: bool = True,
        sampler: Sampler | None = None,
    ) -> None:
        Sampler.__init__(self)  # BatchSampler.__init__ would insist on a fixed batch_size
        if isinstance(sampler, DistributedSampler):
            rank, world_size = sampler.rank, sampler.num_replicas
        if tokens_per_batch is None and max_sentences is None:
            raise ValueError("give tokens_per_batch (>= 1) or batch_size (>= 1) for translation batches")
        self.tokens_per_batch = None if tokens_per_batch is None else check_positive_int("tokens_per_batch", tokens_per_batch)
        self.max_sentences = None if max_sentences is None else check_positive_int("batch_size", max_sentences)
        self.rank, self.world_size = check_replica(rank, world_size)
        self.sizes = list(sizes)
        self.shuffle, self.seed, self.pad_shards, self.epoch = shuffle, int(seed), pad_shards, 0
        # Lightning calls ``set_epoch`` on ``loader.batch_sampler.sampler``; torch types that attribute
        # as an index sampler, and this one yields batches
        self.sampler = self  # type: ignore[assignment]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def all_batches(self) -> list[list[int]]:
        """Every replica's batches for the current epoch, in order, before sharding."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.sizes), generator=g).tolist() if self.shuffle else range(len(self.sizes))
        order = sorted(order, key=lambda i: self.sizes[i])  # stable: random ties when shuffled
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for i in order:
            grown = max(longest, self.sizes[i])
            over_tokens = self.tokens_per_batch is not None and (len(current) + 1) * grown > self.tokens_per_batch
            over_count = self.max_sentences is not None and len(current) + 1 > self.max_sentences
            if current and (over_tokens or over_count):
                batches.append(current)
                current, grown = [], self.sizes[i]
            current.append(i)
            longest = grown
        if current:
            batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def _shard(self, batches: list[list[int]]) -> list[list[int]]:
        if self.world_size == 1:
            return batches
        if self.pad_shards and batches:
            total = math.ceil(len(batches) / self.world_size) * self.world_size
            batches = [batches[j % len(batches)] for j in range(total)]
        return batches[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._shard(self.all_batches()))

    def __len__(self) -> int:
        return len(self._shard(self.all_batches()))

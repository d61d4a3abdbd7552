"""``ResumableDataLoader``: a ``DataLoader`` that can stop mid-epoch and continue at the next batch.

Lightning saves the state of every training loader that has ``state_dict()`` /
``load_state_dict()`` (its ``_Stateful`` protocol) in a checkpoint, under the fit loop's
``combined_loader`` state, and restores it before the loader's first iterator of the resumed
run. This loader's state is ``{"epoch": e, "batches": n}``: the sampler's epoch and how many
batches the current epoch's iterator has yielded. Restoring it sets the sampler's epoch and
makes the next iterator skip the first ``n`` batches of that epoch's order, without loading
them (the skip happens on the index sampler). A state at the end of an epoch (``n`` equal to
the loader's length) continues with the first batch of epoch ``e + 1``.

The resumed run therefore reads exactly the batches the uninterrupted run would have read,
provided the order depends only on (seed, epoch): ``EpochRandomSampler`` and
``TokenBucketBatchSampler`` do. Each iterator also draws its worker base seed from a generator
seeded by (``seed``, epoch) rather than from the global RNG, so creating iterators never
disturbs the global random state (which ``ResumableCheckpoint`` saves and restores).

With ``num_workers > 0`` the batches are the same after a resume, but random transforms in
the workers may differ for the rest of that epoch (their per-worker RNG streams restart).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader


def _set_epoch(loader: DataLoader, epoch: int) -> None:
    """``set_epoch`` on the loader's sampler and batch sampler (as Lightning does)."""
    seen: set[int] = set()
    for obj in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
        set_epoch = getattr(obj, "set_epoch", None)
        if obj is not None and id(obj) not in seen and callable(set_epoch):
            seen.add(id(obj))
            set_epoch(epoch)


def _epoch_of(loader: DataLoader) -> int:
    for obj in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
        epoch = getattr(obj, "epoch", None)
        if isinstance(epoch, int):
            return epoch
    return 0


class _Skip:
    """The index sampler without its first ``count`` items (batches, with automatic batching)."""

    def __init__(self, inner: Iterable[Any], count: int) -> None:
        self.inner, self.count = inner, count

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        for _ in range(self.count):
            next(it, None)
        yield from it

    def __len__(self) -> int:
        return len(cast(Sized, self.inner))  # asked only of a sampler with a length


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict`` / ``load_state_dict`` (see the module docstring).

    Same constructor as ``DataLoader`` (so Lightning can re-create it, e.g. to inject a
    ``DistributedSampler``). Set ``loader.seed`` to make the workers' base seed depend on
    (seed, epoch) only; without it the base seed comes from the global RNG as usual.
    """

    seed: int | None = None
    _yielded = 0
    _pending_skip = 0
    _skip_now = 0

    @property
    def _index_sampler(self) -> Any:  # read by DataLoader's iterators when they (re)start
        base = super()._index_sampler
        return _Skip(base, self._skip_now) if self._skip_now else base

    # torch annotates DataLoader.__iter__ with its private iterator class; any iterator serves
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._pending_skip = self._pending_skip, 0
        if self.seed is not None:
            self.generator = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + _epoch_of(self) + 17)
        self._skip_now = skip
        try:
            iterator = super().__iter__()
        finally:
            self._skip_now = 0
        self._yielded = skip
        return self._counting(iterator)

    def _counting(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": the sampler's epoch, "batches": batches yielded by the current iterator}``."""
        return {"epoch": _epoch_of(self), "batches": int(self._yielded)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at batch ``state["batches"]`` of epoch ``state["epoch"]`` (the next iterator)."""
        epoch, batches = int(state.get("epoch", 0)), int(state.get("batches", 0))
        try:
            length = len(self)
        except TypeError:  # no length: cannot tell an epoch end, keep the position as is
            length = None
        if length is not None and batches >= length:
            epoch, batches = epoch + 1, 0
        _set_epoch(self, epoch)
        self._pending_skip = batches
        self._yielded = batches

"""The lab's one rule for counting the bytes autograd saves for backward (activations, not weights).

The engine's per-stage memory (``pipeline/stage/runtime.py``), per-layer activation costs
(``gpipe_lab.pipeline.measuring.costs``), the capacity planner and the memory benchmark all count
with ``SavedBytes``, so their figures agree. The rule, per saved tensor:

- not an activation: a tensor sharing a storage with an excluded one (the
  module's parameters and buffers, and views of them: frozen ones too);
- skipped: the same view as a ``boundary`` tensor (a stage's inputs, counted on their own);
- counted: each distinct view (storage, offset, shape, strides) once, by its own
  elements (a micro-batch is a view of the whole batch: its storage's size would
  over-count); the views of one storage together count at most the storage's size.

Storages are told apart by their C++ object, which also works on the ``meta``
device, where every data pointer is 0. This module imports torch only: it sits
below the engine and the models, and both may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["SavedBytes", "storage_key", "storage_keys"]


def storage_key(t: Tensor) -> int:
    """The identity of ``t``'s storage (shared by all its views), also on the meta device."""
    key: int = t.untyped_storage()._cdata
    return key


def storage_keys(tensors: Iterable[Tensor]) -> frozenset[int]:
    """``storage_key`` of each tensor (e.g. a module's parameters and buffers)."""
    return frozenset(storage_key(t) for t in tensors)


ViewKey = tuple[int, object, tuple[int, ...], tuple[int, ...], torch.dtype]  # offset: an int or a SymInt


def _view_key(t: Tensor) -> ViewKey:
    return (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _unpack(t: Tensor) -> Tensor:
    return t


class SavedBytes:
    """Counts the activation bytes of the tensors autograd saves (the rule is in the module docstring).

    ``excluded``: storage keys that are not activations (``storage_keys(module.parameters())``);
    ``boundary``: tensors counted elsewhere; ``on_add(n)``: called with every increase, for a
    running total across counters (a stage's live bytes).
    """

    def __init__(self, excluded: Iterable[int] = frozenset(), boundary: Iterable[Tensor] = (),
                 on_add: Callable[[int], object] | None = None) -> None:
        self._excluded = excluded if isinstance(excluded, (set, frozenset)) else frozenset(excluded)
        self._views: set[ViewKey] = {_view_key(t) for t in boundary}
        self._storages: dict[int, int] = {}
        self._alive: list[Tensor] | None = None
        self._on_add = on_add
        self.total = 0

    def add(self, t: Tensor) -> int:
        """Count one saved tensor; returns the bytes it added (0: not an activation, or already counted)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._excluded:
            return 0
        view = (key, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in self._views:
            return 0
        self._views.add(view)
        if self._alive is not None:  # a freed storage's address may be reused within the block
            self._alive.append(t)
        before = self._storages.get(key, 0)
        after = min(storage.nbytes(), before + t.numel() * t.element_size())
        self._storages[key] = after
        added = after - before
        self.total += added
        if added and self._on_add is not None:
            self._on_add(added)
        return added

    def by_storage(self) -> dict[int, int]:
        """Bytes counted per storage key (to tell a layer's saved inputs and outputs from its internals)."""
        return dict(self._storages)

    def _pack(self, t: Tensor) -> Tensor:
        self.add(t)
        return t

    @contextmanager
    def hooks(self) -> Iterator[SavedBytes]:
        """Count every tensor autograd saves inside the block (``saved_tensors_hooks``); yields the counter.

        The counted tensors are kept alive until the block ends, so that no storage key is reused inside it.
        """
        self._alive = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield self
        finally:
            self._alive = None

"""Where each stage forward's random draws come from (``random_replay``: ``"auto"``, True, False).

A re-materialized forward must draw what its first forward drew, and a run must not
depend on thread timing. Every draw is a function of (seed, step, stage, micro-batch).
``StageReplay`` picks, per forward of one stage, the cheapest way that holds:

- ``fork`` (auto, where the stage alone draws from its device's default generator: a
  stage per CUDA device in the local transport, every rank of the distributed one):
  save that generator (the CPU's too in a process of its own), reseed it for the
  micro-batch, restore it afterwards, as ``torch.utils.checkpoint`` does. O(1) per
  forward; fused kernels that read the default generator (attention dropout) are covered.
- ``guard`` (auto, CPU stage threads sharing the default generator): a one-time probe, a
  forward without a graph on the first micro-batch a stage sees in training and in eval
  mode, tells whether the forward draws outside ``StageDropout`` (which every ``nn.Dropout``
  becomes and which draws from the micro-batch's generator by name). If it does not, the
  forward runs as it is, and the default generators' states are compared before and after
  each forward: a draw appearing later raises ``UnreplayableRandomError``.
- ``dispatch`` (auto where the probe found such draws; always with True): the per-op
  ``RandomReplay`` mode routes every draw to the micro-batch's generators.
- ``off`` (False, compiled stages): only ``StageDropout`` draws are replayed.

``fork`` and ``dispatch`` draw the same numbers on CPU (a generator seeded alike).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from gpipe_lab.pipeline.context import microbatch_context
from gpipe_lab.pipeline.options import REPLAY_SETTINGS
from gpipe_lab.pipeline.random_replay import (
    RandomReplay,
    UnreplayableRandomError,
    _default_generator_lock,
    device_seed,
)

__all__ = ["DISPATCH", "FORK", "GUARD", "OFF", "REPLAY_SETTINGS", "StageReplay", "generator_owners"]

FORK, GUARD, DISPATCH, OFF = "fork", "guard", "dispatch", "off"
#: what a stage alone draws from: every default generator of its process, its CUDA device's, none
ALL, DEVICE, NONE = "all", "device", "none"


def default_generator(device: torch.device) -> torch.Generator | None:
    """The default generator of ``device`` (CPU or CUDA), else ``None``."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        torch.cuda.init()  # fills default_generators (a no-op once CUDA is up)
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return None


def generator_owners(devices: Mapping[int, torch.device], num_ranks: int, shared_process: bool) -> dict[int, str]:
    """Per stage (chunk ``j`` runs on rank ``j % num_ranks``): ``ALL`` when its rank is alone in its
    process, ``DEVICE`` when it is the only rank on its CUDA device, else ``NONE``."""
    if not shared_process:
        return {j: ALL for j in devices}
    ranks_on: dict[torch.device, set[int]] = {}
    for j, device in devices.items():
        ranks_on.setdefault(device, set()).add(j % num_ranks)
    return {j: DEVICE if device.type == "cuda" and len(ranks_on[device]) == 1 else NONE
            for j, device in devices.items()}


def _rewinds_nothing(module: nn.Module) -> bool:
    """False if ``module`` holds a layer whose random state no reseeding rewinds (cuDNN RNN dropout)."""
    return not any(isinstance(m, nn.RNNBase) and m.dropout > 0 for m in module.modules())


class StageReplay:
    """How one stage's forwards make their draws repeatable (see the module docstring)."""

    def __init__(self, setting: bool | str, device: torch.device, owner: str, module: nn.Module,
                 index: int) -> None:
        if setting not in REPLAY_SETTINGS or not isinstance(setting, (bool, str)):
            raise ValueError(f"random_replay: must be one of {list(REPLAY_SETTINGS)}, got {setting!r}")
        self.setting, self.device, self.index = setting, device, index
        own = default_generator(device)
        owned = owner == ALL or (owner == DEVICE and device.type == "cuda")
        self.fork = setting == "auto" and owned and own is not None and _rewinds_nothing(module)
        cpu = torch.device("cpu")
        self.forked: list[tuple[torch.device, torch.Generator]] = []
        if self.fork:
            self.forked = [(device, own)] + ([(cpu, torch.default_generator)]
                                             if owner == ALL and device.type != "cpu" else [])
        # the default generators a forward must leave alone (those it does not fork)
        watched = [(cpu, torch.default_generator)] + ([(device, own)] if device.type == "cuda" else [])
        self.watched = [(d, g) for d, g in watched if all(d != f for f, _ in self.forked) and g is not None]
        self.draws: dict[bool, bool] = {}  # per training flag: the probe found draws outside StageDropout

    def first_kind(self, training: bool, probe: Callable[[], None], seed: int) -> str:
        """How a micro-batch's first forward runs; probes the stage the first time it must judge it.

        ``probe`` runs the forward without a graph or side effects; ``StageDropout`` draws in it
        from a generator seeded with ``seed``. Raises what ``probe`` raises.
        """
        if self.setting is True:
            return DISPATCH
        if self.setting is False:
            return OFF
        if self.fork:
            return FORK
        if training not in self.draws:
            self.draws[training] = self._probe(probe, seed)
        return DISPATCH if self.draws[training] else GUARD

    def _probe(self, probe: Callable[[], None], seed: int) -> bool:
        """Whether ``probe`` moves a watched default generator (which is restored afterwards)."""
        with _default_generator_lock:  # a DISPATCH stage reseeds the shared one under this lock
            before = [g.get_state() for _, g in self.watched]
            try:
                with microbatch_context(self._generator(seed), recomputing=True, replay=False):
                    probe()
            finally:
                after = [g.get_state() for _, g in self.watched]
                for (_, g), state in zip(self.watched, before):
                    g.set_state(state)
        return any(not torch.equal(a, b) for a, b in zip(before, after))

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @contextmanager
    def forward(self, kind: str, seed: int, recomputing: bool, where: tuple[int, int]) -> Iterator[RandomReplay | None]:
        """Run one forward of micro-batch ``where = (step, micro-batch)`` the ``kind`` way.

        Yields the ``RandomReplay`` mode for ``DISPATCH`` (its ``draws`` count), else None.

        Raises:
            UnreplayableRandomError: a ``GUARD`` forward moved a default generator (naming the
                stage, the step, the micro-batch and the fix), or what the mode raises.
        """
        if kind == FORK:
            states = [g.get_state() for _, g in self.forked]
            for d, g in self.forked:
                g.manual_seed(device_seed(seed, self.device, d))
            try:
                with microbatch_context(self.forked[0][1], recomputing, replay=False):
                    with self._guarded(where):
                        yield None
            finally:
                for (_, g), state in zip(self.forked, states):
                    g.set_state(state)
            return
        with microbatch_context(self._generator(seed), recomputing, replay=kind == DISPATCH) as mode:
            if kind == GUARD:
                with self._guarded(where):
                    yield None
            else:
                yield mode

    @contextmanager
    def _guarded(self, where: tuple[int, int]) -> Iterator[None]:
        """Raise after the enclosed forward if it moved a watched default generator."""
        if not self.watched:
            yield
            return
        with _default_generator_lock:
            before = [g.get_state() for _, g in self.watched]
        yield
        with _default_generator_lock:
            moved = [d for (d, g), state in zip(self.watched, before) if not torch.equal(g.get_state(), state)]
        if moved:
            raise UnreplayableRandomError(
                f"stage {self.index} drew random numbers outside nn.Dropout in its forward (step {where[0]}, "
                f"micro-batch {where[1]}): the default generator of {moved[0]} moved, though the first "
                "step's probe found no such draw (or another thread of this process drew from it "
                "meanwhile), so re-materialization would not repeat it; set random_replay=True "
                "(pipeline.random_replay=true) to replay every draw")

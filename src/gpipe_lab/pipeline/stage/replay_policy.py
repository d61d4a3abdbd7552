"""Where each stage forward's random draws come from (``random_replay``: ``"auto"``, True, False).

A re-materialized forward must draw what its first forward drew, and a run must not
depend on thread timing. Every draw is a function of (seed, step, stage, micro-batch).
``StageReplay`` picks, per forward of one stage, the cheapest way that holds:

- ``fork`` (auto, where the stage alone draws from its device's default generator: a
  stage per CUDA device in the local transport, every rank of the distributed one):
  save that generator (the CPU's too in a process of its own), reseed it for the
  micro-batch, restore it afterwards, as ``torch.utils.checkpoint`` does. O(1) per
  forward; fused kernels that read the default generator (attention dropout) are covered.
- ``probe`` (auto, CPU stage threads sharing the default generator, first step of each mode:
  the layers' training flags as the step begins): ``fork`` with the shared generators held under a lock for the whole
  forward, watching whether anything but ``StageDropout`` (which every ``nn.Dropout``
  becomes) draws from them. Its re-materialization repeats it the same way.
- ``guard`` (auto, after a probe that found no such draw): the forward runs as it is,
  ``StageDropout`` drawing from a generator of the micro-batch's own. ``StepGuard`` compares
  the shared generators' states before and after each run of a schedule (not each forward:
  a model that draws nothing pays two state reads per step, not two per forward under a
  lock the stage threads contend for): a draw appearing later raises ``UnreplayableRandomError``
  naming the step and the guarded stages.
- ``dispatch`` (auto after a probe that found draws; always with True): the per-op
  ``RandomReplay`` mode routes every draw to the micro-batch's generators.
- ``off`` (False, compiled stages): only ``StageDropout`` draws are replayed.

On CPU every way draws the same numbers (one stream from a generator seeded alike).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from gpipe_lab.pipeline.options import REPLAY_SETTINGS
from gpipe_lab.pipeline.stage.context import microbatch_context
from gpipe_lab.pipeline.stage.random_replay import (
    RandomReplay,
    UnreplayableRandomError,
    _default_generator_lock,
    device_seed,
)

__all__ = ["DISPATCH", "FORK", "GUARD", "OFF", "PROBE", "DrawWatch", "StageReplay", "StepGuard", "generator_owners"]

FORK, PROBE, GUARD, DISPATCH, OFF = "fork", "probe", "guard", "dispatch", "off"
#: what a stage alone draws from: every default generator of its process, its CUDA device's, none
ALL, DEVICE, NONE = "all", "device", "none"
Generators = list[tuple[torch.device, torch.Generator]]

def default_generator(device: torch.device) -> torch.Generator | None:
    """The default generator of ``device`` (CPU or CUDA), else ``None``."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        torch.cuda.init()  # fills default_generators (a no-op once CUDA is up)
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return None


def generator_owners(devices: Mapping[int, torch.device], placement: Sequence[int],
                     shared_process: bool) -> dict[int, str]:
    """Per stage (chunk ``j`` runs on rank ``placement[j]``): ``ALL`` when its rank is alone in its
    process, ``DEVICE`` when it is the only rank on its CUDA device, else ``NONE``."""
    if not shared_process:
        return {j: ALL for j in devices}
    ranks_on: dict[torch.device, set[int]] = {}
    for j, device in devices.items():
        ranks_on.setdefault(device, set()).add(placement[j])
    return {j: DEVICE if device.type == "cuda" and len(ranks_on[device]) == 1 else NONE
            for j, device in devices.items()}


def _rewinds_nothing(module: nn.Module) -> bool:
    """False if ``module`` holds a layer whose random state no reseeding rewinds (cuDNN RNN dropout)."""
    return not any(isinstance(m, nn.RNNBase) and m.dropout > 0 for m in module.modules())


class DrawWatch:
    """Whether a forward drew from ``generators`` other than through ``StageDropout``, which
    brackets its own draws with ``before``/``after``."""

    def __init__(self, generators: Generators) -> None:
        self.expected = [(g, g.get_state()) for _, g in generators]
        self.foreign = False

    def _check(self, generator: torch.Generator | None = None) -> None:
        for g, state in self.expected:
            if (generator is None or g is generator) and not torch.equal(g.get_state(), state):
                self.foreign = True

    def before(self, generator: torch.Generator | None) -> None:
        self._check(generator)

    def after(self, generator: torch.Generator | None) -> None:
        self.expected = [(g, g.get_state() if g is generator else state) for g, state in self.expected]

    def done(self) -> bool:
        """True if anything but the bracketed draws moved a generator."""
        self._check()
        return self.foreign


class StageReplay:
    """How one stage's forwards make their draws repeatable (see the module docstring)."""

    def __init__(self, setting: bool | str, device: torch.device, owner: str, module: nn.Module,
                 index: int) -> None:
        if not isinstance(setting, (bool, str)) or setting not in REPLAY_SETTINGS:
            raise ValueError(f"random_replay: must be one of {list(REPLAY_SETTINGS)}, got {setting!r}")
        self.setting, self.device, self.index = setting, device, index
        own, cpu = default_generator(device), torch.device("cpu")
        # no generator to reseed, or cuDNN RNN dropout (whose state only the mode can refuse, by name)
        self.probes = own is not None and (device.type != "cuda" or _rewinds_nothing(module))
        owned = owner == ALL or (owner == DEVICE and device.type == "cuda")
        self.fork = setting == "auto" and owned and self.probes
        self.forked: Generators = []
        if self.fork and own is not None:  # (fork implies probes, which implies own)
            self.forked = [(device, own)] + ([(cpu, torch.default_generator)]
                                             if owner == ALL and device.type != "cpu" else [])
        # the default generators a forward must leave alone (those it does not fork), its own first
        watched = ([(device, own)] if device.type == "cuda" else []) + [(cpu, torch.default_generator)]
        self.watched: Generators = [(d, g) for d, g in watched
                                    if g is not None and all(d != f for f, _ in self.forked)]
        # per mode (each layer's training flag, ``StageRuntime.mode``): the probe saw draws outside StageDropout
        self.draws: dict[Hashable, bool] = {}
        self.settled: set[Hashable] = set()  # the modes whose probe step is over

    def settle(self) -> None:
        """A new step begins: the probes of the last one are final."""
        self.settled.update(self.draws)

    def guards(self, training: Hashable) -> bool:
        """Whether this step's forwards in mode ``training`` run ``GUARD`` (``first_kind``, without
        its side effect)."""
        return (self.setting == "auto" and not self.fork and self.probes and training in self.settled
                and not self.draws[training] and bool(self.watched))

    def first_kind(self, training: Hashable) -> str:
        """How a micro-batch's first forward runs (its re-materialization runs the same way,
        except a ``DISPATCH`` forward that drew nothing, which needs no mode)."""
        if self.setting is True or (self.setting == "auto" and not self.fork and not self.probes):
            return DISPATCH
        if self.setting is False:
            return OFF
        if self.fork:
            return FORK
        if training in self.settled:
            return DISPATCH if self.draws[training] else GUARD
        self.draws.setdefault(training, False)
        return PROBE

    def forward(self, kind: str, seed: int, recomputing: bool,
                training: Hashable) -> AbstractContextManager[RandomReplay | None]:
        """Run one forward of the micro-batch seeded ``seed`` the ``kind`` way.

        Yields the ``RandomReplay`` mode for ``DISPATCH`` (its ``draws`` count), else None.

        Raises:
            UnreplayableRandomError: what the mode raises (a ``GUARD`` forward is checked by ``StepGuard``).
        """
        if kind in (FORK, PROBE):
            return self._reseeded(kind, seed, recomputing, training)
        # a forward that only guards or replays StageDropout makes its generator at the first draw, if any
        return microbatch_context(torch.Generator(device=self.device).manual_seed(seed) if kind == DISPATCH
                                  else None, recomputing, replay=kind == DISPATCH, lazy=(self.device, seed))

    @contextmanager
    def _reseeded(self, kind: str, seed: int, recomputing: bool, training: Hashable) -> Iterator[None]:
        """A ``FORK`` or ``PROBE`` forward: the default generators reseeded for it, restored after."""
        generators = self.forked if kind == FORK else self.watched
        with _default_generator_lock if kind == PROBE else nullcontext():
            states = [g.get_state() for _, g in generators]
            for d, g in generators:
                g.manual_seed(device_seed(seed, self.device, d))
            watch = DrawWatch(generators) if kind == PROBE and not recomputing else None
            try:
                with microbatch_context(generators[0][1], recomputing, replay=False, watch=watch):
                    yield None
                if watch is not None and watch.done():
                    self.draws[training] = True
            finally:
                for (_, g), state in zip(generators, states):
                    g.set_state(state)


def _state_bytes(generator: torch.Generator) -> bytes:
    """``generator``'s state as bytes: comparing them costs far less than ``torch.equal`` per forward."""
    return generator.get_state().numpy().tobytes()


class StepGuard:
    """One run of a schedule in this process, for the stages whose forwards run ``GUARD``: the
    default generators they must leave alone, read before the run and compared after it. A class
    the core makes per run; nothing is read when no stage guards."""

    def __init__(self, replays: Sequence[tuple[StageReplay, Hashable]]) -> None:
        guarded = [r for r, training in replays if r.guards(training)]
        self.stages = sorted(r.index for r in guarded)
        generators = {id(g): (d, g) for r in guarded for d, g in r.watched}
        with _default_generator_lock:  # a probing stage of another pipeline holds them reseeded
            self.before = [(d, g, _state_bytes(g)) for d, g in generators.values()]

    def check(self, step: int) -> None:
        """Raises:
            UnreplayableRandomError: a watched default generator moved during the run (naming the
                guarded stages, the step and the fix).
        """
        if not self.before:
            return
        with _default_generator_lock:
            moved = [d for d, g, state in self.before if _state_bytes(g) != state]
        if moved:
            who = (f"stage {self.stages[0]}" if len(self.stages) == 1 else
                   "one of stages " + ", ".join(map(str, self.stages)) + " (their forwards ran in the same step)")
            raise UnreplayableRandomError(
                f"{who} drew random numbers outside nn.Dropout in a forward of step {step}: the default "
                f"generator of {moved[0]} moved, though the first step's probe found no such draw (or another "
                "thread of this process drew from it meanwhile), so re-materialization would not repeat it; set "
                "random_replay=True (pipeline.random_replay=true) to replay every draw")

"""Where each long skip goes: from the stage that stashes it to the stage that pops it.

``skip_layout(layers, balance)`` reads the layers' ``@skippable`` declarations once, at
construction, checks them (every pop has one earlier stash, every stash one later pop,
no name twice) and places each skip between the stages that hold its two layers. A
skip inside one stage stays inside it (the stage's ``SkipFrame``); a skip across stages
becomes a message from its stash stage to its pop stage (``StageSkips``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from gpipe_lab.pipeline.skip.api import SkipError, SkipFrame, declared


@dataclass(frozen=True)
class Skip:
    """One skip tensor: its name, the layers that stash and pop it, and their stages."""

    name: str
    stash_layer: int
    pop_layer: int
    src: int
    dst: int


Group = tuple[int, tuple[str, ...]]  # (the other stage, the names exchanged with it, in order)


@dataclass(frozen=True)
class StageSkips:
    """The skips crossing one stage's boundary: ``inbound`` popped here from earlier stages,
    ``outbound`` stashed here for later ones, each grouped by the other stage (one message
    per group and micro-batch) and ordered by stage, then name."""

    stage: int
    inbound: tuple[Group, ...]
    outbound: tuple[Group, ...]

    @property
    def num_inbound(self) -> int:
        return sum(len(names) for _, names in self.inbound)

    @property
    def num_outbound(self) -> int:
        return sum(len(names) for _, names in self.outbound)

    def frame(self, inputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], SkipFrame]:
        """Split a stage's inputs into the boundary inputs and a frame holding the popped skips
        (the last ``num_inbound`` inputs, in ``inbound`` order)."""
        n = self.num_inbound
        main, skips = (inputs[:len(inputs) - n], inputs[len(inputs) - n:]) if n else (inputs, ())
        names = [name for _, group in self.inbound for name in group]
        return main, SkipFrame(dict(zip(names, skips)), (name for _, group in self.outbound for name in group))

    def outputs(self, frame: SkipFrame, mb: int) -> tuple[Tensor, ...]:
        """The stashed tensors later stages pop, in ``outbound`` order.

        Raises:
            SkipError: a declared stash that the forward did not make.
        """
        values = []
        for dst, names in self.outbound:
            for name in names:
                if name not in frame.stashed:
                    raise SkipError(f"stage {self.stage} (micro-batch {mb}) declares the stash of {name!r} "
                                    f"for stage {dst}, but its forward did not stash it")
                values.append(frame.stashed[name])
        return tuple(values)


def _describe(index: int, layer: nn.Module) -> str:
    return f"layer {index} ({type(layer).__name__})"


class SkipLayout:
    """Every skip of a cut model (``skip_layout``); ``stage(j)`` is one stage's share."""

    def __init__(self, skips: Sequence[Skip], num_stages: int) -> None:
        self.skips = tuple(skips)
        self.num_stages = num_stages
        self.crossing = tuple(s for s in self.skips if s.src != s.dst)

    def stage(self, j: int) -> StageSkips | None:
        """Stage ``j``'s crossing skips; ``None`` when none crosses its boundary (nothing to do)."""
        def groups(pairs: list[tuple[int, str]]) -> tuple[Group, ...]:
            others = sorted({o for o, _ in pairs})
            return tuple((o, tuple(sorted(n for p, n in pairs if p == o))) for o in others)

        inbound = groups([(s.src, s.name) for s in self.crossing if s.dst == j])
        outbound = groups([(s.dst, s.name) for s in self.crossing if s.src == j])
        return StageSkips(j, inbound, outbound) if inbound or outbound else None

    def pairs(self) -> list[tuple[int, int]]:
        """The (stash stage, pop stage) pairs a crossing skip connects, each once, sorted."""
        return sorted({(s.src, s.dst) for s in self.crossing})


def skip_layout(layers: Sequence[nn.Module], balance: Sequence[int]) -> SkipLayout:
    """Check the layers' skip declarations and place each skip between two stages.

    ``balance``: layers per (virtual) stage, in order.

    Raises:
        SkipError: a pop with no earlier stash (or one that comes before its stash), a name stashed
            or popped twice, a stash that no later layer pops; the message names the layers and the
            name.
    """
    stage_of = [j for j, count in enumerate(balance) for _ in range(count)]
    stashed: dict[str, int] = {}
    popped: dict[str, int] = {}
    skips: list[Skip] = []
    found = [(i, layer, [declared(m) for m in layer.modules()]) for i, layer in enumerate(layers)]
    for i, layer, decls in found:
        for name in (n for stashes, _ in decls for n in stashes):
            if name in stashed:
                raise SkipError(f"skip {name!r} is stashed twice: by {_describe(stashed[name], layers[stashed[name]])}"
                                f" and by {_describe(i, layer)}; rename one or isolate() it in a namespace")
            stashed[name] = i
        for name in (n for _, pops in decls for n in pops):
            if name in popped:
                raise SkipError(f"skip {name!r} is popped twice: by {_describe(popped[name], layers[popped[name]])}"
                                f" and by {_describe(i, layer)}; a stashed tensor is popped once")
            popped[name] = i
            if name not in stashed:
                later = next((j for j, _, d in found if j > i and any(name in s for s, _ in d)), None)
                where = ("no layer stashes it" if later is None else
                         f"its stash comes later, in {_describe(later, layers[later])} (stage "
                         f"{stage_of[later]}, after this pop's stage {stage_of[i]})")
                raise SkipError(f"{_describe(i, layer)} pops skip {name!r}, but {where}; a pop must follow "
                                f"its stash")
            skips.append(Skip(name, stashed[name], i, stage_of[stashed[name]], stage_of[i]))
    for name, i in stashed.items():
        if name not in popped:
            raise SkipError(f"{_describe(i, layers[i])} stashes skip {name!r}, but no later layer pops it")
    return SkipLayout(skips, len(balance))

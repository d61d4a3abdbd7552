"""One walk over a stage's modules per step: its modules, parameters and buffers, as torch lists them.

``nn.Module.parameters()`` and ``buffers()`` each walk the tree through a chain of
generators (``named_modules`` → ``_named_members``) and build a name per member: a
cost per module on every call, which a stage of hundreds of modules pays several times
per step if each user of the lists walks for itself. ``walk``
visits the tree once, iteratively, and gives the same lists in the same order: every
module in pre-order, each shared module, parameter or buffer once, ``None`` entries
skipped. A module that overrides ``parameters()`` itself is not consulted (torch's
own modules, parametrizations and compiled wrappers keep theirs in the tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


@dataclass(frozen=True)
class ModuleWalk:
    """What one walk of a module found (see the module docstring)."""

    modules: tuple[nn.Module, ...]
    parameters: tuple[nn.Parameter, ...]
    buffers: tuple[Tensor, ...]


def walk(module: nn.Module) -> ModuleWalk:
    """``module.modules()``, ``parameters()`` and ``buffers()`` of ``module``, from one visit."""
    modules: list[nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        modules.append(m)
        stack.extend(child for child in reversed(m._modules.values()) if child is not None)
    return ModuleWalk(tuple(modules), _members(modules, "_parameters"), _members(modules, "_buffers"))


def _members(modules: list[nn.Module], table: str) -> tuple[Any, ...]:
    found, seen = [], set()
    for m in modules:
        for t in getattr(m, table).values():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                found.append(t)
    return tuple(found)

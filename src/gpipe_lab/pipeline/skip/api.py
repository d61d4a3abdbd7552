"""The user's side of long skip connections: ``@skippable``, ``stash`` and ``pop``.

A layer declares the skip tensors it stashes and pops; inside its ``forward`` it
calls ``stash(name, tensor)`` and ``pop(name)``::

    @skippable(stash=["enc1"])
    class Down(nn.Module):
        def forward(self, x):
            y = self.conv(x)
            stash("enc1", y)          # kept for a later layer
            return self.pool(y)

    @skippable(pop=["enc1"])
    class Up(nn.Module):
        def forward(self, x):
            return self.conv(torch.cat([self.up(x), pop("enc1")], 1))

Where the tensor goes depends on who runs the layers. A stage that skips cross opens a
``SkipFrame`` around each micro-batch's forward (``layout.StageSkips.frame``): a stashed
tensor that a later stage pops becomes an output of this stage sent straight to that
stage, and a popped one arrives as an extra input of the stage. A skip inside one stage,
like every skip without a pipeline (the plain ``nn.Sequential``), waits in the frame or in
a per-thread store from its ``stash`` to its ``pop``, in the one autograd graph of that forward.

Names live in a layer's namespace (``layer.isolate("level2")``), so one class can
be used at several places of a model: its names become ``"level2/enc1"``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import Tensor, nn

T = TypeVar("T", bound=type[nn.Module])

_local = threading.local()  # .layers: skippable layers whose forward runs; .frames; .store


class SkipError(ValueError):
    """A skip connection declared or used wrongly (the message names the layer and the name)."""


class SkipFrame:
    """The skip tensors of one micro-batch's forward on one pipeline stage (a context: ``with frame:``).

    ``values`` holds what ``pop`` may take: the tensors stashed in earlier stages for this one,
    and those stashed and popped inside this stage. ``outbound`` names the tensors a later stage
    pops: a stash of one of them is kept in ``stashed`` for the stage to send.

    ``detach``: a pop returns a leaf of its own (as a later stage receives it), for a layer run
    and back-propagated alone (``measuring.costs.time_layers``).
    """

    def __init__(self, inbound: dict[str, Tensor], outbound: Iterable[str] = (), detach: bool = False) -> None:
        self.values = inbound
        self.outbound = frozenset(outbound)
        self.stashed: dict[str, Tensor] = {}
        self.detach = detach

    def stash(self, name: str, tensor: Tensor) -> None:
        (self.stashed if name in self.outbound else self.values)[name] = tensor

    def pop(self, name: str) -> Tensor | None:
        tensor = self.values.pop(name, None)
        if self.detach and tensor is not None:
            return tensor.detach().requires_grad_(tensor.is_floating_point())
        return tensor

    def __enter__(self) -> SkipFrame:
        """Make this the calling thread's current frame: its ``stash`` / ``pop`` calls use it."""
        _stack("frames").append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _stack("frames").pop()

    def run(self, fn: Callable[[Any], Any], x: Any) -> Any:
        """``fn(x)`` with this frame as the calling thread's current one."""
        with self:
            return fn(x)


def _stack(name: str) -> list[Any]:
    stack = getattr(_local, name, None)
    if stack is None:
        stack = []
        setattr(_local, name, stack)
    return stack


def _store() -> dict[str, Tensor]:
    store = getattr(_local, "store", None)
    if store is None:
        store = _local.store = {}
    return store


def _qualified(module: nn.Module, name: str) -> str:
    namespace = getattr(module, "skip_namespace", None)
    return name if not namespace else f"{namespace}/{name}"


def declared(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The qualified names ``module`` (itself, not its children) stashes and pops; ((), ()) if
    it is not skippable."""
    stashes = getattr(type(module), "skip_stash", ())
    pops = getattr(type(module), "skip_pop", ())
    return tuple(_qualified(module, n) for n in stashes), tuple(_qualified(module, n) for n in pops)


def _current(call: str, name: str, kind: str) -> tuple[nn.Module, str]:
    """The skippable layer whose forward calls ``call(name)``, and ``name`` qualified by its namespace.

    Raises:
        SkipError: no skippable layer's forward is running, or it did not declare ``name``.
    """
    layers = _stack("layers")
    if not layers:
        raise SkipError(f"{call}({name!r}) called outside the forward of a @skippable layer; decorate the "
                        f"layer's class with @skippable({kind}=[{name!r}])")
    layer = layers[-1]
    names = getattr(type(layer), f"skip_{kind}", ())
    if name not in names:
        raise SkipError(f"{type(layer).__name__} calls {call}({name!r}) but declares {kind}={list(names)}; "
                        f"add {name!r} to @skippable({kind}=...)")
    return layer, _qualified(layer, name)


def stash(name: str, tensor: Tensor) -> None:
    """Keep ``tensor`` under ``name`` for a later layer's ``pop`` (call it in a skippable forward).

    Raises:
        SkipError: outside a skippable layer's forward, or ``name`` not in its ``stash`` list.
        TypeError: ``tensor`` is not a tensor.
    """
    layer, qualified = _current("stash", name, "stash")
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{type(layer).__name__} stashes {name!r} as {type(tensor).__name__}; a skip must "
                        f"be a tensor")
    frames = _stack("frames")
    if frames:
        frames[-1].stash(qualified, tensor)
    else:
        _store()[qualified] = tensor


def pop(name: str) -> Tensor:
    """The tensor an earlier layer stashed under ``name`` (taken: a name is popped once per forward).

    Raises:
        SkipError: outside a skippable layer's forward, ``name`` not in its ``pop`` list, or
            nothing was stashed under it in this forward.
    """
    layer, qualified = _current("pop", name, "pop")
    frames = _stack("frames")
    tensor = frames[-1].pop(qualified) if frames else _store().pop(qualified, None)
    if tensor is None:
        raise SkipError(f"{type(layer).__name__} pops {qualified!r}, but no earlier layer stashed it in "
                        f"this forward")
    return tensor


M = TypeVar("M", bound=nn.Module)


def isolate(layer: M, namespace: str) -> M:
    """Put ``layer``'s skip names in ``namespace`` (``"ns/name"``), so that one class can serve
    several skips; returns the layer. Also a method of every skippable class: ``layer.isolate(ns)``."""
    layer.__dict__["skip_namespace"] = str(namespace)  # a plain attribute, not a tensor or module
    return layer


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[T], T]:
    """Class decorator: the layer's ``forward`` may ``stash`` the names in ``stash`` and ``pop``
    those in ``pop``. The class gains ``isolate(namespace)`` (one class at several places).

    Raises:
        SkipError: a name that is not a non-empty string, or given twice.
    """
    stashes, pops = tuple(stash), tuple(pop)
    for kind, names in (("stash", stashes), ("pop", pops)):
        for n in names:
            if not isinstance(n, str) or not n:
                raise SkipError(f"skippable({kind}=...): a skip name must be a non-empty string, got {n!r}")
        if len(set(names)) != len(names):
            raise SkipError(f"skippable({kind}={list(names)}): a name is listed twice")

    def decorate(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, got {cls!r}")
        original = cls.forward

        @functools.wraps(original)
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            layers = _stack("layers")
            layers.append(self)
            try:
                return original(self, *args, **kwargs)
            finally:
                layers.pop()

        # the user's class, decorated once where it is defined; ``declared`` reads the names back
        cls.forward = forward
        cls.skip_stash = stashes  # type: ignore[attr-defined]  # added to the user's class here
        cls.skip_pop = pops  # type: ignore[attr-defined]  # added to the user's class here
        cls.isolate = isolate  # type: ignore[attr-defined]  # added to the user's class here
        return cls

    return decorate

"""Random replay: every random draw of a stage's forward comes from its micro-batch generators.

A checkpointed micro-batch runs its forward twice (once without a graph, once
in the backward to rebuild it), and the two must draw the same random numbers,
whatever the other stage threads do in between. ``RandomReplay`` is a
thread-local ``TorchDispatchMode`` entered around the stage forwards that need it
(``replay_policy`` says which: with ``random_replay=True`` every one; with ``"auto"``
those of CPU stages found drawing outside ``nn.Dropout``); it sees every aten op
below autograd and:

- gives every random op that takes a generator (``bernoulli_``, ``uniform_``,
  ``normal_``, ``rrelu_with_noise``, ``multinomial`` ...) the micro-batch's
  generator of the op's device, whatever generator the caller named;
- sends ``rand``/``randn``/``randint``/``randperm``/``*_like`` to their
  ``.generator`` overloads with that generator;
- runs ``native_dropout`` (the fused dropout of accelerators) as a dropout that
  takes that generator (``fused_dropout``: one kernel on CUDA);
- runs any other seeded op (fused attention kernels with dropout, which read
  the device's default generator) with the device's default generator reseeded
  from the micro-batch, under a lock (``replay_policy`` moves the shared default
  generators only under it too), and restores its state afterwards;
- refuses, naming the layer, a draw it cannot replay (cuDNN RNN dropout keeps
  its own state; devices without a default generator) before any output exists.

Non-random ops pass straight through (one dictionary lookup). The draws are a
function of (seed, step, stage, micro-batch) and of the op order inside the
forward only, so two runs with the same seed are bitwise equal. ``draws``
counts the ops that drew (a dropout of probability 0 draws nothing), so a
caller can tell a forward that drew nothing.
"""

from __future__ import annotations

import sys
import threading
import zlib
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RandomReplay", "UnreplayableRandomError", "device_seed", "fused_dropout", "generator_argument"]

_MASK = (1 << 63) - 1
_SEEDED = torch.Tag.nondeterministic_seeded
# the overload of the same op that takes a generator
_WITH_GENERATOR = {"default": "generator", "out": "generator_out", "low": "low_generator",
                   "low_out": "low_generator_out", "Tensor": "Tensor_generator",
                   "Tensor_out": "Tensor_generator_out", "low_dtype": "low_generator_dtype",
                   "low_dtype_out": "low_generator_dtype_out"}
# seeded ops that hold random state of their own, which no generator can rewind
_UNREPLAYABLE = {"_cudnn_rnn", "miopen_rnn"}
_default_generator_lock = threading.RLock()

Handler = Callable[["RandomReplay", Any, tuple[Any, ...], dict[str, Any]], Any]


class UnreplayableRandomError(RuntimeError):
    """A stage forward drew random numbers in a way its re-materialization cannot repeat."""


def _current_layer() -> str:
    """The innermost ``nn.Module.forward`` on the Python stack (for error messages)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and frame.f_code.co_name == "forward":
            extra = owner.extra_repr()
            return f"{type(owner).__name__}({extra})"
        frame = frame.f_back
    return "<no nn.Module on the stack>"


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Where the op runs: its first tensor argument, else ``device=``, else its ``out=`` tensor."""
    for a in args:
        if isinstance(a, Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor):
            return a[0].device
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    out = next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
    return out.device if out is not None else torch.device("cpu")


def _with_generator(func: Any) -> Handler:
    """Pass the micro-batch generator as the op's ``generator`` argument."""
    arguments = func._schema.arguments
    index = next(i for i, a in enumerate(arguments) if a.name == "generator")
    positional = not arguments[index].kwarg_only

    def handler(mode: RandomReplay, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode.draws += 1
        gen = mode.generator_for(_device_of(args, kwargs))
        if positional and len(args) > index:
            args = args[:index] + (gen,) + args[index + 1:]
        else:
            kwargs = {**kwargs, "generator": gen}
        return f(*args, **kwargs)

    return handler


def _redirect(target: Any) -> Handler:
    """Call the ``.generator`` overload instead of the one without a generator."""
    def handler(mode: RandomReplay, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode.draws += 1
        return target(*args, **kwargs, generator=mode.generator_for(_device_of(args, kwargs)))

    return handler


def _native_dropout(mode: RandomReplay, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = dict(zip(("input", "p", "train"), args), **kwargs)
    x, p, train = bound["input"], float(bound["p"]), bound.get("train")
    if train is False:
        return f(*args, **kwargs)
    if p >= 1.0:
        return x * 0.0, torch.zeros_like(x, dtype=torch.bool)
    mode.draws += 1
    return fused_dropout(x, p, mode.generator_for(x.device))


def generator_argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    """The generator an aten op was called with (a keyword or, as ``_fused_dropout``'s, positional)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            return kwargs.get("generator", args[i] if i < len(args) and not a.kwarg_only else None)
    return None


def _dropout_probability(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "dropout", "p"):
            value = kwargs.get(a.name, args[i] if i < len(args) else a.default_value)
            return float(value or 0.0)
    return None


def _reseeded_default(mode: RandomReplay, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an op that reads the device's default generator with that generator reseeded."""
    p = _dropout_probability(f, args, kwargs)
    if p == 0.0:
        return f(*args, **kwargs)  # no draw: no need to hold the other stages up
    name = f._schema.name.split("::")[-1]
    if name in _UNREPLAYABLE:
        raise UnreplayableRandomError(
            f"layer {_current_layer()} draws random numbers with {f} (dropout={p}), whose random "
            "state the pipeline cannot rewind, so a re-materialized micro-batch would get other "
            "masks; use checkpoint='never', dropout=0, or a non-cuDNN implementation of the layer")
    device = _device_of(args, kwargs)
    if device.type == "cpu":
        default = torch.default_generator
    elif device.type == "cuda":
        default = torch.cuda.default_generators[device.index if device.index is not None
                                                else torch.cuda.current_device()]
    else:
        raise UnreplayableRandomError(
            f"layer {_current_layer()} draws random numbers with {f} on {device}, whose default "
            "generator the pipeline cannot reseed; use checkpoint='never' for this model")
    mode.draws += 1
    with _default_generator_lock:
        state = default.get_state()
        default.manual_seed(mode.next_seed())
        try:
            return f(*args, **kwargs)
        finally:
            default.set_state(state)


def _plan(func: Any) -> Handler | None:
    """How ``func`` is replayed; ``None`` for an op that draws nothing."""
    if _SEEDED not in func.tags:
        return None
    if any(a.name == "generator" for a in func._schema.arguments):
        return _with_generator(func)
    packet = func.overloadpacket
    sibling = _WITH_GENERATOR.get(func._overloadname)
    if sibling is not None and sibling in packet.overloads():
        return _redirect(getattr(packet, sibling))
    if packet is torch.ops.aten.native_dropout and func._overloadname == "default":
        return _native_dropout
    return _reseeded_default


_plans: dict[Any, Handler | None] = {}


class RandomReplay(TorchDispatchMode):
    """Routes the random ops of one micro-batch's forward to generators seeded from ``generator``.

    ``generator`` serves ops on its own device; ops on other devices get their
    own generator, seeded from ``generator``'s seed and the device.
    Raises ``UnreplayableRandomError`` (naming the layer) for a draw it cannot replay.
    """

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        self.seed = generator.initial_seed()
        self.device = generator.device
        self.generators = {_key(generator.device): generator}
        self.calls = 0
        self.draws = 0  # random numbers drawn so far (0: this forward drew nothing)

    def generator_for(self, device: torch.device) -> torch.Generator:
        key = _key(device)
        gen = self.generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(device_seed(self.seed, self.device, device))
            self.generators[key] = gen
        return gen

    def next_seed(self) -> int:
        self.calls += 1
        return _mix(self.seed, (1 << 20) + self.calls)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            plan = _plans[func]
        except KeyError:
            plan = _plans[func] = _plan(func)
        if plan is None:
            return func(*args, **kwargs)
        return plan(self, func, args, kwargs)


def device_seed(seed: int, stage_device: torch.device, device: torch.device) -> int:
    """The seed of the micro-batch generator of ``device`` in a stage on ``stage_device``
    whose micro-batch seed is ``seed`` (what ``RandomReplay.generator_for`` seeds)."""
    key = _key(device)
    return seed if key == _key(stage_device) else _mix(seed, zlib.crc32(f"{key[0]}:{key[1]}".encode()))


def _key(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, -1 if device.index is None else device.index)


def _mix(seed: int, part: int) -> int:
    return (seed * 6364136223846793005 + 1442695040888963407 + part) & _MASK


# Inverted dropout with a named generator (``StageDropout`` and the replayed ``native_dropout``), in as
# few full-size passes as the device allows. On CUDA, ``torch._fused_dropout`` draws the mask and scales in one kernel and takes a
# generator (``native_dropout``, the kernel behind ``F.dropout``, only reads the default one);
# its backward saves the one-byte mask. Elsewhere the mask is drawn straight into a bool
# tensor (the same numbers as ``bernoulli_`` on a float tensor: one draw per element) and
# applied by ``where``, whose backward saves only that bool mask, then scaled in place.
def fused_dropout(x: Tensor, p: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """``(x`` with each element zeroed with probability ``p`` and the rest scaled by ``1/(1-p)``,
    the bool keep mask``)``; the mask is drawn from ``generator`` (the default one if ``None``).

    ``p`` must be in ``[0, 1)`` (callers check it).
    """
    if x.is_cuda and x.numel() > 0:
        out, keep = torch._fused_dropout(x, 1.0 - p, generator)  # its p is the keep probability
        return out, keep.view(torch.bool)  # a 0/1 byte mask: the same bytes read as bool
    keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p, generator=generator)
    return torch.where(keep, x, x.new_zeros(())).mul_(1.0 / (1.0 - p)), keep

"""Each stage's parameters are created on its own device, never elsewhere.

Used by both transports (``GPipe``: every stage on its device; ``DistributedGPipe``:
only this rank's chunks). Three ways in:

* a real ``nn.Sequential`` (e.g. built on CPU after ``torch.manual_seed``, the
  same on every rank): each stage's layers move to its device; in the distributed
  transport the other ranks' layers are turned into ``meta`` tensors (freed). Init
  is identical to the unpipelined model by construction; fine for models that fit
  in host memory.
* a module built on the ``meta`` device (``with torch.device("meta"): ...``):
  only the local layers are materialized (``to_empty``) and initialized, by
  ``init_fn(layer_index, layer)`` or by ``reset_parameters()`` under the seed
  ``seed + layer_index``. ``seeded_init(model, seed)`` applies the same rule to
  an unpipelined model, which then starts from identical weights *on the same
  device type*: a CUDA generator draws other numbers than the CPU's from the
  same seed, so to compare a GPU pipeline with a CPU copy, initialize on the
  CPU (build the real module there) and move it.
* a factory (a callable returning the ``nn.Sequential``): called under
  ``torch.device("meta")``, then as above. Nothing of a giant model is ever
  allocated outside its own rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

InitFn = Callable[[int, nn.Module], None]


def build_module(module: nn.Module | Callable[[], nn.Module]) -> nn.Sequential:
    """Resolve a module or a factory (called on the meta device).

    Raises:
        TypeError: not an ``nn.Sequential`` (or a factory that does not return one).
    """
    if not isinstance(module, nn.Module) and callable(module):
        with torch.device("meta"):
            module = module()
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"the pipeline needs an nn.Sequential (or a factory returning one), "
                        f"got {type(module).__name__}")
    return module


def convert_keeping_ties(layers: Sequence[nn.Module], convert: Callable[[nn.Module], object]) -> None:
    """``convert`` each of ``layers`` (``to_empty``, ``to("meta")``), then tie again what was tied:
    a parameter or buffer that two of them shared is one tensor after, as before. Torch converts
    module by module and would give each holder a copy of its own."""
    holders = [(table, name, id(t)) for layer in layers for m in layer.modules()
               for table in (m._parameters, m._buffers) for name, t in table.items() if t is not None]
    for layer in layers:
        convert(layer)
    first: dict[int, object] = {}
    retied: set[int] = set()
    for table, name, key in holders:
        if key in first:
            table[name] = first[key]  # type: ignore[assignment]
            retied.add(key)
        else:
            first[key] = table[name]
    if retied:  # an RNN caches its weights' list: rebuild it from the tied ones
        for layer in layers:
            for m in layer.modules():
                if isinstance(m, nn.RNNBase):
                    m._init_flat_weights()


def is_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in list(layer.parameters()) + list(layer.buffers()))


def reset_module(module: nn.Module) -> bool:
    """Call ``module``'s own ``reset_parameters`` (or ``reset_running_stats``); False if it has none."""
    for hook in ("reset_parameters", "reset_running_stats"):
        if callable(getattr(module, hook, None)):
            getattr(module, hook)()
            return True
    return False


def reset_layer(layer: nn.Module) -> None:
    """``reset_module`` on every submodule of ``layer`` (itself included)."""
    for m in layer.modules():
        reset_module(m)


def init_layer(index: int, layer: nn.Module, seed: int, init_fn: InitFn | None) -> None:
    """Initialize one layer deterministically from (seed, global layer index).

    Only the generators of the layer's own devices are seeded, and all are restored
    after (``torch.manual_seed`` would reseed every CUDA generator for good).
    """
    cuda = sorted({t.device.index for t in [*layer.parameters(), *layer.buffers()] if t.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed + index)
        for d in cuda:
            torch.cuda.default_generators[d].manual_seed(seed + index)
        if init_fn is not None:
            init_fn(index, layer)
        else:
            reset_layer(layer)


def seeded_init(module: nn.Sequential, seed: int, init_fn: InitFn | None = None) -> nn.Sequential:
    """Initialize a whole model exactly like the meta path initializes its partitions.

    Equal weights need the same device type as the partitions (see the module docstring).
    """
    with torch.no_grad():
        for i, layer in enumerate(module):
            init_layer(i, layer, seed, init_fn)
    return module


def place_layers(part: nn.Sequential, first: int, device: torch.device, seed: int,
                 init_fn: InitFn | None = None) -> None:
    """Put the layers of one chunk (global indices ``first``, ...) on ``device``.

    A real layer is moved; a layer on ``meta`` is allocated on ``device`` (``to_empty``)
    and initialized by ``init_layer`` with its global index, so it is never allocated
    anywhere else.

    Raises:
        ValueError: a layer is only partly on the meta device.
    """
    with torch.no_grad():
        on_meta = []
        for i, layer in enumerate(part):
            meta = [t.is_meta for t in list(layer.parameters()) + list(layer.buffers())]
            if any(meta) and not all(meta):
                raise ValueError(f"layer {first + i} is partly on the meta device; build it "
                                 "entirely on meta (or entirely on a real device)")
            if any(meta):
                on_meta.append(i)
            else:
                layer.to(device)
        # allocated together, so a weight tied between two layers of the chunk stays one weight
        convert_keeping_ties([part[i] for i in on_meta], lambda layer: layer.to_empty(device=device))
        for i in on_meta:
            init_layer(first + i, part[i], seed, init_fn)


def local_chunks(module: nn.Sequential, balance: Sequence[int], chunk_ids: Sequence[int],
                 device: torch.device, seed: int, init_fn: InitFn | None = None,
                 release_others: bool = True) -> dict[int, tuple[int, nn.Sequential]]:
    """The chunks this rank holds: chunk id -> (index of its first layer, layers on ``device``).

    Raises:
        ValueError: a layer is only partly on the meta device.
    """
    layers = list(module)  # not children(): a layer listed twice must keep both places
    starts = [sum(balance[:j]) for j in range(len(balance))]
    local = {}
    for j in chunk_ids:
        first = starts[j]
        part = nn.Sequential(*layers[first:first + balance[j]])
        place_layers(part, first, device, seed, init_fn)
        local[j] = (first, part)
    with torch.no_grad():
        if release_others:
            mine = {id(layer) for _, part in local.values() for layer in part}
            others = [layer for layer in layers if id(layer) not in mine and not is_meta(layer)]
            # the user's module keeps its shape on every rank: tied weights stay tied on meta
            convert_keeping_ties(others, lambda layer: layer.to("meta"))
    return local

"""The non-finite step policy: detect NaN/inf, agree on a verdict, describe it.

Every front door decides the same way. After a step each holder of stages builds
a verdict vector over its own stages; the channel sums the vectors over every
rank (locally: nothing to sum), so all ranks read the same verdict::

    slot 0       this replica's loss share (loss / D)
    slot 1       > 0 if some rank's loss is NaN/inf
    slot 2       the loss's dtype, as its index in LOSS_DTYPES (each of the D holders adds 1/D)
    slot 3 + j   > 0 if (virtual) stage j's gradients are NaN/inf somewhere

The vector is float64 on every rank, so a float64 model's loss crosses unrounded, and every
rank returns the loss in the dtype the last stage computed it in.

A stage's gradients are judged by one fused, read-only kernel per device and dtype
(``gradient_flag``: the largest magnitude of each gradient, which writes nothing), not by
kernels per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.devices.assignment import to_device


class NonFiniteError(FloatingPointError):
    """The loss or a stage's gradients are NaN or infinite (policy ``nonfinite="raise"``)."""


def dense_values(t: Tensor) -> Tensor:
    """The values a sparse tensor stores (coalesced, so duplicates are summed as its dense form
    sums them); a strided tensor itself."""
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout != torch.strided:
        return t.values()  # compressed layouts (CSR, CSC, BSR, BSC) hold no duplicates
    return t


def nonfinite_flag(tensors: Iterable[Tensor | None]) -> Tensor | None:
    """A 0-d bool tensor, True if some element of some tensor is NaN/inf; computed without a host sync.

    Each tensor's minimum and maximum are read (``aminmax``: one pass, no
    tensor-sized temporary; of a sparse tensor, its stored values); NaN propagates through both and an infinity is one
    of them, and unlike a sum they cannot overflow on large finite values (a complex tensor is read
    as its real and imaginary parts).
    Tensors on several devices are combined on the first one's (a GPU flag reaches a
    CPU first tensor by a blocking copy). ``None`` entries
    are skipped; returns ``None`` when nothing is left.
    """
    present = [dense_values(t.detach()) for t in tensors if t is not None]
    present = [t for t in present if t.numel() > 0]
    if not present:
        return None
    device = present[0].device
    extremes = []
    for t in present:
        low, high = torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)
        extremes.append(to_device(torch.stack([low, high]).float(), device))
    return ~torch.isfinite(torch.cat(extremes)).all()


#: gradient dtypes the fused check takes (others take ``nonfinite_flag``)
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


#: where ``torch._foreach_norm`` of order inf is one fast fused kernel; on the CPU it is not, and
#: ``nonfinite_flag``'s aminmax pass per tensor is the fast read-only check there
#: (``python -m benchmarks.probes.nonfinite_check`` times both)
FUSED_DEVICE_TYPES = {"cuda"}


def gradient_flag(grads: Iterable[Tensor | None]) -> Tensor | None:
    """A 0-d float64 tensor, > 0 if some element of some gradient is NaN/inf; without a host sync.

    One fused kernel per device and dtype (``torch._foreach_norm`` of order inf: each gradient's
    largest magnitude, NaN or inf when some element is; it reads the gradients without writing
    them, as ``GradScaler``'s check at scale one would, and cannot overflow since it sums
    nothing). Gradients it cannot take (other dtypes, sparse ones, devices outside
    ``FUSED_DEVICE_TYPES``, the CPU's among them) are judged by ``nonfinite_flag``. The flag is on the first gradient's device (a flag from another
    device reaches a CPU one by a blocking copy); ``None`` entries and empty tensors are skipped;
    returns ``None`` when nothing is left.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    rest: list[Tensor] = []
    for g in grads:
        if g is None or g.numel() == 0:
            continue
        if g.dtype in _FUSED_DTYPES and g.layout == torch.strided and g.device.type in FUSED_DEVICE_TYPES:
            groups.setdefault((g.device, g.dtype), []).append(g)
        else:
            rest.append(g)
    flags: list[Tensor] = []
    with torch.no_grad():
        for group in groups.values():
            try:
                norms = torch.stack(torch._foreach_norm(group, float("inf")))
            except (RuntimeError, NotImplementedError):  # a kernel this build lacks for the dtype
                rest.extend(group)
                continue
            flags.append((~torch.isfinite(norms).all()).double())
    other = nonfinite_flag(rest)
    if other is not None:
        flags.append(other.double())
    if not flags:
        return None
    first = flags[0].device
    return flags[0] if len(flags) == 1 else torch.stack([to_device(f, first) for f in flags]).sum()


def all_finite(tensors: Iterable[Tensor | None]) -> bool:
    """Whether every element of every tensor is finite (``None`` entries are skipped); one host sync."""
    flag = nonfinite_flag(tensors)
    return flag is None or not bool(flag)


#: the dtypes a loss is returned in (slot 2 names one; others come back as float32)
LOSS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: slots before the per-stage flags
_FLAGS = 3


def loss_dtype(values: Sequence[float]) -> torch.dtype:
    """The loss's dtype named by slot 2 of the summed vector's host copy."""
    return LOSS_DTYPES[round(values[2])]


def verdict_vector(loss: Tensor | None, modules: Mapping[int, nn.Module | Iterable[Tensor]], num_chunks: int,
                   dp_size: int, check: bool, device: torch.device,
                   flags: Mapping[int, Tensor | None] | None = None) -> Tensor:
    """This rank's contribution: its loss share and, with ``check``, its non-finite marks.

    ``modules`` maps each (virtual) stage held here to its layers, or to their parameters
    (the stage's ``step_walk().parameters``, walked once per step); a stage in ``flags`` has
    its ``gradient_flag`` taken already (by its worker: ``stage_flags``). Built on
    ``device`` from device-side flags only: nothing here waits for the device;
    ``read_verdict`` is the step's one read.
    """
    slots: list[Tensor] = [torch.zeros((), device=device, dtype=torch.float64)] * (_FLAGS + num_chunks)
    if loss is not None:
        slots[0] = (loss.detach().double() / dp_size).to(device)
        code = LOSS_DTYPES.index(loss.dtype) if loss.dtype in LOSS_DTYPES else 0
        slots[2] = torch.full((), code / dp_size, dtype=torch.float64, device=device)  # no host copy
    if check:
        if loss is not None:
            slots[1] = (~torch.isfinite(loss.detach()).all()).double().to(device)
        for j, module in modules.items():
            if flags is not None and j in flags:
                flag = flags[j]
            else:
                params = module.parameters() if isinstance(module, nn.Module) else module
                flag = gradient_flag(p.grad for p in params)
            if flag is not None:
                slots[_FLAGS + j] = to_device(flag, device)
    return torch.stack(slots)


def read_verdict(shared: Tensor) -> list[float]:
    """The summed verdict vector on the host: the step's single device-to-host read."""
    return shared.detach().cpu().tolist()


def describe_problem(shared: Tensor | Sequence[float], num_stages: int, virtual_stages: int,
                     loss: Tensor | None = None) -> str | None:
    """What the summed vector says went wrong, or ``None`` when the step is finite.

    ``shared`` is the vector or its host copy (``read_verdict``); ``loss`` (when
    this rank holds the whole loss) is quoted instead of slot 0.
    """
    values = read_verdict(shared) if isinstance(shared, Tensor) else list(shared)

    def name(chunk: int) -> str:
        return str(chunk) if virtual_stages == 1 else f"{chunk % num_stages} (chunk {chunk})"

    if values[1] > 0:
        value = values[0] if loss is None else loss.item()
        return f"loss is {value} (computed on stage {name(num_stages * virtual_stages - 1)})"
    bad = [j for j in range(len(values) - _FLAGS) if values[_FLAGS + j] > 0]
    return f"gradients of stage {name(bad[0])} are not finite" if bad else None

"""Loss scaling (``16-mixed``) under the pipeline: the ``GradScaler`` decides, the same on every stage.

With a scaler, an overflow of the scaled gradients is expected, not an error:
the scaler unscales, finds the inf, skips that optimizer step and backs the
scale off, and ``update`` runs every step. So the engine's own non-finite
policy is switched off while a scaler is active (``engine_nonfinite``), and in
distributed runs each rank's inf verdict is summed over every rank before the
step (``agree_on_overflow``), so all stages skip together and their scales stay
equal. Reading the scale for the logged loss would wait for the device, so the
loss is unscaled by a device tensor (``unscale_loss``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def active_scaler(precision_plugin: Any) -> Any:
    """The precision plugin's enabled ``GradScaler``, or ``None``."""
    scaler = getattr(precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def engine_nonfinite(policy: str, precision_plugin: Any) -> str:
    """The engine's policy: ``policy``, or ``"ignore"`` when a scaler owns the inf check."""
    return "ignore" if active_scaler(precision_plugin) is not None else policy


def unscale_loss(loss: Tensor, scaler: Any) -> Tensor:
    """``loss`` divided by the current scale, without reading the scale on the host."""
    return loss / scaler.scale(torch.ones((), device=loss.device, dtype=torch.float32))


def agree_on_overflow(scaler: Any, group: Any = None) -> None:
    """Make ``scaler.unscale_`` sum its inf verdict over the ranks of ``group`` (all by default).

    Each rank's optimizer holds only its stage's parameters; without agreement
    one stage would step while another skips. Like torch's sharded scaler, the
    per-device verdicts ``unscale_`` records are replaced by the global one.

    Raises:
        RuntimeError: this torch's ``GradScaler`` does not keep per-optimizer
            verdicts where expected (its internals changed).
    """
    if getattr(scaler, "_gpipe_agreeing", False):
        return
    original = scaler.unscale_

    def unscale_(optimizer: Any) -> None:
        original(optimizer)
        states = getattr(scaler, "_per_optimizer_states", None)
        if states is None or "found_inf_per_device" not in states[id(optimizer)]:
            raise RuntimeError("GradScaler keeps no per-optimizer inf verdicts here; cannot agree across "
                               "pipeline ranks (unsupported torch version)")
        found = states[id(optimizer)]["found_inf_per_device"]
        device = scaler._scale.device
        total = torch.zeros(1, device=device, dtype=torch.float32)
        for flag in found.values():
            total += flag.to(device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=group)
        if not found:  # this rank holds no gradient: it still takes part in the verdict
            found[device] = total
        for key, flag in found.items():
            found[key] = total.to(flag.device)

    scaler.unscale_ = unscale_
    scaler._gpipe_agreeing = True

"""Loss scaling (``16-mixed``) under the pipeline: the ``GradScaler`` decides, the same on every stage.

With a scaler, an overflow of the scaled gradients is expected, not an error:
the scaler unscales, finds the inf, skips that optimizer step and backs the
scale off, and ``update`` runs every step. So the engine's own non-finite
policy is switched off while a scaler is active (``engine_nonfinite``), and in
distributed runs each rank's inf verdict is summed over every rank before the
step (``agreeing_precision``: torch's ``ShardedGradScaler``), so all stages skip
together and their scales stay equal. Reading the scale for the logged loss would
wait for the device, so the loss is unscaled by a device tensor (``unscale_loss``).
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


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


def agreeing_precision(precision_plugin: Any) -> Any:
    """``precision_plugin``, or for ``16-mixed`` with a ``GradScaler`` a ``MixedPrecision`` whose
    scaler sums each rank's inf verdict over every process before the step.

    Each rank's optimizer holds only its stage's parameters (and data-parallel replicas average
    gradients scaled by their own scale): without agreement one stage would step while another
    skips, and the scales would drift apart. torch's ``ShardedGradScaler`` all-reduces the
    verdict over its ``process_group`` (here every process), also on a rank without gradients.
    The new scaler starts from the given one's scale and growth settings.
    """
    scaler = active_scaler(precision_plugin)
    if not isinstance(precision_plugin, MixedPrecision) or scaler is None or isinstance(scaler, ShardedGradScaler):
        return precision_plugin
    agreeing = ShardedGradScaler(precision_plugin.device, init_scale=scaler.get_scale(),
                                 growth_factor=scaler.get_growth_factor(),
                                 backoff_factor=scaler.get_backoff_factor(),
                                 growth_interval=scaler.get_growth_interval(), process_group=dist.group.WORLD)
    mixed = cast(Literal["16-mixed", "bf16-mixed"], precision_plugin.precision)  # a MixedPrecision's own
    return MixedPrecision(mixed, precision_plugin.device, scaler=agreeing)

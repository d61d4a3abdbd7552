"""Deferred BatchNorm: the paper's rule for BatchNorm under micro-batching.

Each micro-batch is normalized with its own statistics (as a small batch would
be), while the running mean and variance are updated once per mini-batch from
the statistics of the whole mini-batch. Sums are not accumulated while a
checkpointed micro-batch is recomputed, so every sample counts once.

What counts as a mini-batch is what ``nn.BatchNorm`` would see as one call on
the unpipelined module: a ``train_step`` (committed at its end, unless the step
is skipped), and equally a training-mode forward ``pipe(x)``, with or without a
graph: its sums are committed when the forward ends (``commit_forward``), not
left pending for the next step. So forward, then ``train_step``, then eval
gives the running statistics ``nn.BatchNorm`` gives for the same calls (exactly
with one micro-batch; with M > 1 for the first BatchNorm, later ones see
micro-batch-normalized inputs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from gpipe_lab.pipeline.stage.context import is_recomputing


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm whose running statistics commit once per mini-batch (see ``commit``)."""

    sum: Tensor
    sum_squares: Tensor
    count: Tensor
    # always tracked (``track_running_stats=True``): never None here
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        # float64 sums: E[x^2] - E[x]^2 over a whole mini-batch loses digits in float32
        self.register_buffer("sum", torch.zeros(num_features, dtype=torch.float64), persistent=False)
        self.register_buffer("sum_squares", torch.zeros(num_features, dtype=torch.float64),
                             persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.long), persistent=False)
        self._pending = 0  # samples per channel accumulated, known on the host

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects at least 2-D input, got {x.dim()}-D")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():
            with torch.no_grad():
                self._accumulate(x.detach())
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _accumulate(self, x: Tensor) -> None:
        """Add one micro-batch's per-channel sums, without a float64 copy of ``x``.

        ``var_mean`` reads ``x`` once, in float32 for a 16-bit input (whose own-dtype
        result would round the statistics to 16 bits, where ``nn.BatchNorm`` keeps
        float32); only the per-channel results are widened to float64.
        """
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x.float() if x.element_size() < 4 else x, dim=dims, correction=0)
        mean64 = mean.to(self.sum.dtype)
        self.sum += mean64 * n
        self.sum_squares += (var.to(self.sum.dtype) + mean64 * mean64) * n
        self.count += n
        self._pending += n  # the host's copy of ``count``: commit reads it without a device sync

    @torch.no_grad()
    def commit(self) -> bool:
        """Fold the accumulated mini-batch statistics into the running ones (no device sync).

        Returns False (and changes nothing) when nothing was accumulated.
        """
        n = self._pending
        if n == 0:
            return False
        mean = self.sum / n
        var = (self.sum_squares / n - mean * mean).clamp_min(0.0)
        unbiased = var * (n / (n - 1)) if n > 1 else var
        self.num_batches_tracked += 1
        # momentum=None: a cumulative average, 1 / batches as a tensor (reading it would sync)
        factor = 1.0 / self.num_batches_tracked if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_((mean * factor).to(self.running_mean.dtype))
        self.running_var.mul_(1 - factor).add_((unbiased * factor).to(self.running_var.dtype))
        self.reset_accumulators()
        return True

    def hand_over_pending(self, samples: int) -> int:
        """Set the host's count of accumulated samples to ``samples`` (the sums moved between processes
        with it); returns the count it held."""
        held, self._pending = self._pending, samples
        return held

    def reset_accumulators(self) -> None:
        """Drop partial sums (after a failed step)."""
        self.sum.zero_()
        self.sum_squares.zero_()
        self.count.zero_()
        self._pending = 0

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` (in place; returns the root).

        The new layer reuses the original's parameter and running-statistics tensors
        (dtype included), so an optimizer built on the module keeps working.
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, cls) and module.track_running_stats:
            # tracked statistics: tensors, never None
            mean, var, batches = cast("tuple[Tensor, Tensor, Tensor]",
                                      (module.running_mean, module.running_var, module.num_batches_tracked))
            with torch.device(mean.device):  # meta stays meta: nothing allocated
                bn = cls(module.num_features, module.eps, module.momentum, module.affine)
            if module.affine:
                bn.weight, bn.bias = module.weight, module.bias
            # the original buffers themselves: their dtype too (a float64 model keeps float64 statistics)
            bn.running_mean, bn.running_var = mean, var
            bn.num_batches_tracked = batches
            bn.train(module.training)
            return bn
        for name, child in list(module.named_children()):
            new = cls.convert(child)
            if new is not child:
                setattr(module, name, new)
        return module


def commit_forward(module: nn.Module) -> int:
    """End a training-mode forward of ``module``: commit each ``DeferredBatchNorm``'s sums.

    The forward (all its micro-batches) is one mini-batch, as one call of
    ``nn.BatchNorm`` on the whole batch. Layers that accumulated nothing (eval
    mode, or already committed) are left alone, so calling it twice is harmless.
    Returns the number of layers whose running statistics changed.
    """
    return sum(m.commit() for m in module.modules() if isinstance(m, DeferredBatchNorm))


def running_stat_layers(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The layers among ``modules`` (e.g. ``module.modules()``) whose training-mode forward moves
    running statistics (``nn.BatchNorm*``, ``nn.InstanceNorm*`` with ``track_running_stats``; not
    the deferred kind)."""
    return [m for m in modules if isinstance(m, _NormBase) and m.track_running_stats
            and not isinstance(m, DeferredBatchNorm)]


@contextmanager
def running_stats_untouched(layers: list[nn.Module]) -> Iterator[None]:
    """Undo, on exit, what the enclosed forward did to ``layers``' buffers.

    A re-materialized forward replays a micro-batch whose first forward already
    updated the running statistics; a second update would count it twice.
    """
    saved = [(m, {n: b.clone() for n, b in m.named_buffers(recurse=False)}) for m in layers if m.training]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in saved:
                for n, b in m.named_buffers(recurse=False):
                    # through ``.data``: the replay's graph saved these buffers (a training-mode
                    # batch norm's backward takes them, unread), and restoring their values must not
                    # count as an in-place change of what that backward needs
                    b.data.copy_(buffers[n])

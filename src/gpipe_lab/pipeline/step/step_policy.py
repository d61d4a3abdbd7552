"""What ends a step, on every rank alike: the non-finite verdict and the deferred BatchNorm commit.

After a step (``train_step``, or ``pipe(x)``'s backward) each process builds
its verdict vector (``nonfinite``), the endpoint sums it over every rank, and
all ranks raise ``NonFiniteError`` or skip the step together. Under
``nonfinite="ignore"`` nothing is checked; a process holding every stage then
builds no vector and reads nothing from the device. Deferred
BatchNorm statistics are committed after a good step and dropped after a failed
or skipped one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.pipeline.stage.batchnorm import DeferredBatchNorm
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.channel import Endpoint
from gpipe_lab.pipeline.step.nonfinite import (
    NonFiniteError,
    describe_problem,
    loss_dtype,
    read_verdict,
    verdict_vector,
)


class StepPolicy:
    """Mixed into ``PipelineCore``: the verdict of a finished step and the BatchNorm commit."""

    options: PipelineOptions
    runtimes: dict[int, StageRuntime]
    channel: Endpoint
    step_count: int
    skipped_steps: int
    last_step_skipped: bool
    _num_ranks: int
    _dp_size: int

    @property
    def _num_virtual(self) -> int:
        return self._num_ranks * self.options.virtual_stages

    def _judge(self, loss: Tensor | None, step: int | None = None) -> Tensor:
        """Share the loss and the non-finite verdict over every rank, then apply the policy to all
        alike; returns the full-batch loss (zero when there is none). ``step`` names the step in
        the error (default: ``step_count``).

        Raises:
            NonFiniteError: a NaN/inf loss or gradient under ``nonfinite="raise"``.
        """
        device = next(iter(self.runtimes.values())).device if loss is None else loss.device
        check = self.options.nonfinite != "ignore"
        if not check and self.channel.holds_all_stages:  # nothing to judge, nothing to share: no read
            self.last_step_skipped = False
            return loss if loss is not None else torch.zeros((), device=device)
        modules = {j: r.step_walk().parameters for j, r in self.runtimes.items()}
        shared = self.channel.share(verdict_vector(loss, modules, self._num_virtual, self._dp_size, check,
                                                   device))
        values = read_verdict(shared)  # the step's one device-to-host read
        whole = self.channel.holds_all_stages and loss is not None
        self._apply_policy(describe_problem(values, self._num_ranks, self.options.virtual_stages,
                                            loss if whole else None), step)
        if whole:
            return loss  # type: ignore[return-value]
        return shared[0].to(loss_dtype(values))

    def _apply_policy(self, problem: str | None, step: int | None = None) -> None:
        """Raise, or skip the step (drop the gradients), on every rank alike."""
        self.last_step_skipped = False
        if problem is None:
            return
        self._reset_batch_norm()
        if self.options.nonfinite == "raise":
            raise NonFiniteError(f"step {self.step_count if step is None else step}: {problem} "
                                 "(set nonfinite='skip' to skip such steps)")
        for runtime in self.runtimes.values():
            runtime.module.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.last_step_skipped = True

    def _batch_norms(self) -> list[DeferredBatchNorm]:
        found = {id(m): m for r in self.runtimes.values() for m in r.step_walk().modules
                 if isinstance(m, DeferredBatchNorm)}
        return list(found.values())

    def _commit_batch_norm(self) -> None:
        for m in self._batch_norms():
            m.commit()

    def _reset_batch_norm(self) -> None:
        for m in self._batch_norms():
            m.reset_accumulators()

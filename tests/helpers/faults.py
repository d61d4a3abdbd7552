"""Layers that fail on purpose: a raise in one micro-batch's forward/backward/recompute,
an inf on one training step (for the non-finite policy).

Spawned distributed workers import this module, so it must not import Lightning (seconds
per process): ``Faulty``, the only Lightning piece, is built on first access.
"""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

from gpipe_lab.pipeline.stage.context import current_generator, is_recomputing, microbatch_seed

SEED = 11
NUM_STAGES = 3
CHUNKS = 4


class InjectedFault(RuntimeError):
    """A distinct type, so the test sees that the original type reaches the caller."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fault):
        ctx.fault = fault
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fault.armed:
            raise InjectedFault("injected fault in backward")
        return grad, None


class Fault(nn.Module):
    """Identity that raises in the forward / backward / recompute of ONE micro-batch.

    The micro-batch is recognized by the stage generator the engine installs for it
    (seeded per (seed, step, stage, micro-batch)), so the fault is exact whatever
    order the schedule runs the micro-batches in.
    """

    def __init__(self, when: str, stage: int, microbatch: int, step: int = 0) -> None:
        super().__init__()
        self.when, self.armed = when, True
        self.target_seed = microbatch_seed(SEED, step, stage, microbatch)

    def _is_target(self) -> bool:
        gen = current_generator()
        return gen is not None and gen.initial_seed() == self.target_seed

    def forward(self, x):
        if not (self.armed and self._is_target()):
            return x
        if self.when == "forward" and not is_recomputing():
            raise InjectedFault("injected fault in forward")
        if self.when == "recompute" and is_recomputing():
            raise InjectedFault("injected fault in recompute")
        if self.when == "backward" and torch.is_grad_enabled():
            return _RaiseInBackward.apply(x, self)
        return x


class ExitOnce(nn.Module):
    """Identity that ends its process (exit code 3) on a batch whose first value is above 100:
    a stage process that dies (``local_stages="processes"``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.flatten()[0] > 100:
            os._exit(3)
        return x


class HangOnce(nn.Module):
    """Identity that hangs for ``seconds`` on a batch whose first value is above 100: a stage
    process that stops answering (its computation never returns within the pipe's timeout)."""

    def __init__(self, seconds: float = 120.0) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.flatten()[0] > 100:
            threading.Event().wait(self.seconds)  # nothing sets it: a computation that hangs
        return x


BAD_STEP = 2


class InfAtStep(nn.Module):
    """Multiplies by inf in training on the owner's batch ``step`` (forward, or backward only)."""

    def __init__(self, step: int, where: str = "forward") -> None:
        super().__init__()
        self.step, self.where = step, where
        self._owner: list = []  # not a submodule: no cycle in the module tree

    def attach(self, owner: object) -> InfAtStep:
        self._owner[:] = [owner]
        return self

    def armed(self) -> bool:
        trainer = self._owner[0]._trainer if self._owner else None
        return self.training and trainer is not None and trainer.fit_loop.total_batch_idx == self.step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed():
            return x
        if self.where == "forward":
            return x * float("inf")
        return InfGrad.apply(x)


class InfGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by inf."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def nonfinite_worker(rank: int, world: int) -> dict:
    """One rank of ``DistributedGPipe(nonfinite=...)`` on a loss, a gradient and a skipped
    step with inf, each followed by a clean step (``run_local`` worker)."""
    import torch.nn.functional as F

    from gpipe_lab.pipeline import NonFiniteError
    from gpipe_lab.pipeline.distributed import DistributedGPipe

    out: dict = {}
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    for case in ("loss", "grad", "skip"):
        torch.manual_seed(0)
        bad = InfAtStep(0, "backward" if case == "grad" else "forward")
        bad.armed = lambda b=bad: b.training and b.step == 0  # type: ignore[method-assign]
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), bad, nn.Linear(6, 6))
        pipe = DistributedGPipe(model, balance=[2, 2], chunks=2, seed=1, timeout=30,
                                nonfinite="skip" if case == "skip" else "raise")
        try:
            pipe.train_step(x, y, F.mse_loss)
            out[case] = ("ok", pipe.last_step_skipped, pipe.skipped_steps,
                         all(p.grad is None for p in pipe.parameters()))
        except NonFiniteError as exc:
            out[case] = ("raised", str(exc))
        bad.step = -1  # the next step is clean on every rank
        pipe.zero_grad(set_to_none=True)  # what the optimizer's zero_grad does between steps
        loss = pipe.train_step(x, y, F.mse_loss)
        out[case + "_next"] = (bool(torch.isfinite(loss)), pipe.last_step_skipped, pipe.step_count)
    return out


def _faulty_class() -> type:
    from helpers.strategy import TinyRegressor

    class Faulty(TinyRegressor):
        """TinyRegressor with ``InfAtStep`` after its second layer (stage 0 of K=2)."""

        def __init__(self, step: int = BAD_STEP, where: str = "forward", skip_batch: int | None = None) -> None:
            super().__init__()
            self.layers.insert(2, InfAtStep(step, where).attach(self))
            self.skip_batch = skip_batch
            self.optimizer_steps = 0

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == self.skip_batch else loss  # the reference: no step on that batch

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = super().configure_optimizers()

            def count(*_: object) -> None:
                self.optimizer_steps += 1

            optimizer.register_step_pre_hook(count)
            return optimizer

    Faulty.__qualname__ = "Faulty"  # pickles by reference as helpers.faults.Faulty
    return Faulty


def __getattr__(name: str) -> type:
    if name == "Faulty":
        globals()["Faulty"] = _faulty_class()
        return globals()["Faulty"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""How ``GPipeStrategy`` runs a mini-batch through the pipeline (both transports).

The gradient-zeroing trap: with automatic optimization Lightning calls
``training_step``, THEN zeroes the gradients, THEN ``backward``. A schedule run in
``training_step`` would lose its gradients, so::

    training_step(batch)  -> stash the batch, return a placeholder that requires grad
    zero_grad()           -> (Lightning)
    backward(placeholder) -> run the whole schedule (forward + backward of every
                             micro-batch), log the REAL loss through the module
    optimizer.step()      -> one step per mini-batch (or per accumulation window)

With manual optimization the module calls ``self.pipeline_loss(batch)``, which runs
the schedule at once and returns the real loss; ``manual_backward`` of it is a no-op.

Non-finite policy ``"skip"``: the engine drops the gradients of a mini-batch whose loss
or gradients are NaN/inf and says so (``pipe.last_step_skipped``, agreed by all ranks in
distributed runs); ``optimizer_step`` then runs the closure but not the step, for that
mini-batch's accumulation window, and ``train/skipped_steps`` counts such mini-batches.
Lightning still counts the step in ``global_step`` (as it does for an AMP-skipped step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor

from gpipe_lab.lightning.engine import PipelineEngine
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.scaling import active_scaler, unscale_loss


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


class PipelineRunnerMixin:
    """Training and evaluation steps of ``GPipeStrategy`` through its engine (``self.pipe``)."""

    pipe: PipelineEngine | None
    precision_plugin: Any
    nonfinite: str

    def init_runner(self) -> None:
        """The runner's state: nothing pending, nothing run yet."""
        self._pending: Any = None
        self._skip_pending = False
        self._scheduled_loss: Tensor | None = None
        self.last_loss: Tensor | None = None
        self.last_batch_size: tuple[int, int | Tensor] = (0, 0)

    def _module(self) -> PipelineModule:
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise TypeError(f"GPipeStrategy needs a gpipe_lab.lightning.PipelineModule, got "
                            f"{type(module).__name__}")
        return module

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if not module.automatic_optimization:
            return super().training_step(*args, **kwargs)
        self._pending = args[0] if args else kwargs["batch"]
        return torch.zeros((), device=self.root_device, requires_grad=True)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if closure_loss is self._scheduled_loss:  # manual optimization: pipeline_loss ran the schedule
            self._scheduled_loss = None
            return closure_loss
        if self._pending is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        batch, self._pending = self._pending, None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        self.run_pipeline(batch, 1.0 / accumulate)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """With ``nonfinite="skip"``: no step when the engine skipped a mini-batch of the window."""
        if self.nonfinite != "skip":
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        result = closure()  # training_step + backward: runs the schedule (automatic optimization)
        skip, self._skip_pending = self._skip_pending, False
        if skip:
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)  # type: ignore[misc]

    def run_manual(self, batch: Any) -> Tensor:
        """``PipelineModule.pipeline_loss`` under this strategy: the schedule, then the loss."""
        loss = self.run_pipeline(batch, 1.0).clone()
        self._scheduled_loss = loss  # its manual_backward is a no-op: its gradients are in place
        return loss

    def run_pipeline(self, batch: Any, scale: float) -> Tensor:
        """Forward and backward of every micro-batch of ``batch``; logs and returns the real loss.

        Gradients accumulate into the parameters, multiplied by ``scale`` (1 / the number
        of accumulated mini-batches).
        """
        module = self._module()
        inputs, targets = module.split_batch(batch)
        targets = _to_device(targets, self.output_device)
        scaler = active_scaler(self.precision_plugin)

        def loss_fn(outputs: Any, target: Any) -> Tensor:
            loss = module.loss_fn(outputs, target) * scale
            return scaler.scale(loss) if scaler is not None else loss

        pipe = self._engine()
        # The batch index numbers the step's random generators, so a resumed run draws the
        # dropout masks the uninterrupted run drew.
        step = max(0, module.trainer.fit_loop.total_batch_idx)
        # the whole batch's outputs are gathered only for a log_train that can read them
        # (a Transformer's logits: megabytes copied per step for nothing otherwise)
        wants_outputs = type(module).log_train is not PipelineModule.log_train
        # entered once: the engine carries it into every stage thread and each replay
        with self.precision_plugin.forward_context():
            result = pipe.train_step(inputs, targets, loss_fn, module.loss_normalizer,
                                     return_outputs=wants_outputs, step=step)
        loss, outputs = result if wants_outputs else (result, None)
        loss = loss.detach().float()
        if scaler is not None:
            loss = unscale_loss(loss, scaler)
        real = (loss / scale).to(self.root_device)
        self.last_loss = real
        self.last_batch_size = module.count_samples(inputs, targets)
        if pipe.last_step_skipped:
            self._skip_pending = True
        # Lightning allows self.log in the strategy's backward hook (same options as training_step).
        self.log_train(module, real, outputs, targets)
        if self.nonfinite == "skip":
            module.log("train/skipped_steps", float(pipe.skipped_steps))
        return real

    def log_train(self, module: PipelineModule, loss: Tensor, outputs: Any, targets: Any) -> None:
        """``module.log_train`` of one mini-batch (the distributed transport shares the last stage's)."""
        module.log_train(loss, outputs, targets)

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None:
        """Clip the gradients of ``optimizer`` by the norm over every stage (``PipelineModule``'s
        ``configure_gradient_clipping``); here, every stage's gradients are in this process."""
        self.precision_plugin.clip_gradients(optimizer, max_norm, GradClipAlgorithmType.NORM)

    def _engine(self) -> PipelineEngine:
        if self.pipe is None:
            raise RuntimeError("GPipeStrategy has no pipeline yet: it is built in setup() by the Trainer")
        return self.pipe

    def pipeline_forward(self, inputs: Any) -> Any:
        """Forward only through the pipeline (validation, test, decoding).

        Lightning evaluates under ``torch.inference_mode``, which is thread-local: the
        stage threads would try to record autograd on inference tensors, so the inputs
        are cloned into normal tensors first.
        """
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                inputs = _clone(inputs)
                return self.pipeline_forward(inputs)
        with self.precision_plugin.forward_context():
            outputs = self._engine()(inputs)
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        return _to_device(outputs, first.device)

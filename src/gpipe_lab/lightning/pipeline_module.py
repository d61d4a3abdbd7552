"""``PipelineModule``: a plain LightningModule that a ``GPipeStrategy`` can pipeline.

A subclass declares three things and never sees a micro-batch:

- the layer sequence: a ``layers`` ``nn.Sequential`` attribute (or a ``configure_layers()``
  hook that returns one);
- the loss: ``loss_fn(outputs, targets)``, the mean loss of any slice of the batch, or
  with ``loss_normalizer(targets)`` (e.g. the number of non-pad tokens), a SUM that the
  engine divides by the whole mini-batch's normalizer;
- the metrics: ``log_train(loss, outputs, targets)`` and ``validation_step``.

Layers built in Lightning's ``configure_model`` hook are created on ``meta`` under a
``GPipeStrategy`` and allocated stage by stage on each stage's device; ``init_layer``
initializes each of them there (default: ``reset_parameters()`` under the seed
``seed + layer index``, which ``gpipe_lab.pipeline.seeded_init`` reproduces unpipelined).

Without a ``GPipeStrategy`` (any other Lightning strategy) the same module trains
unpipelined, which is how the tests compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.distributed.state_dict import named_after
from gpipe_lab.pipeline.partitioning.materialize import reset_layer

LossFn = Callable[[Any, Any], Tensor]
#: One ``self.log`` call: name, value, positional and keyword options.
LogRecord = tuple[str, Any, tuple, dict]


class PipelineRunner(Protocol):
    """What a ``GPipeStrategy`` attaches to the module: the pipelined forward and step."""

    def pipeline_forward(self, inputs: Any) -> Any: ...

    def run_manual(self, batch: Any) -> Tensor: ...

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None: ...


class PipelineModule(pl.LightningModule):
    """Base class of the pipelined LightningModules (see the module docstring)."""

    layers: nn.Sequential

    def __init__(self) -> None:
        super().__init__()
        self.pipeline: PipelineRunner | None = None
        self._log_records: list[LogRecord] | None = None

    def attach_pipeline(self, runner: PipelineRunner | None) -> None:
        """Route ``forward`` and ``pipeline_loss`` through ``runner`` (``None``: the plain layers).

        ``GPipeStrategy`` attaches itself in ``setup`` and detaches in ``teardown``.
        """
        self.pipeline = runner

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``; inside ``recording_logs()`` each call is also recorded."""
        if self._log_records is not None:
            self._log_records.append((name, value, args, kwargs))
        super().log(name, value, *args, **kwargs)

    @contextmanager
    def recording_logs(self) -> Iterator[list[LogRecord]]:
        """Record every ``self.log`` call (``log_dict`` goes through it) made inside the block."""
        previous, self._log_records = self._log_records, []
        try:
            yield self._log_records
        finally:
            self._log_records = previous

    # ------------------------------------------------------------ what subclasses give
    def configure_layers(self) -> nn.Sequential:
        """The layer sequence. Default: the ``layers`` attribute.

        Raises:
            AttributeError: the module has neither ``layers`` nor an override of this hook.
        """
        layers = getattr(self, "layers", None)
        if not isinstance(layers, nn.Sequential):
            raise AttributeError(f"{type(self).__name__} needs a `layers` nn.Sequential attribute "
                                 "or a configure_layers() hook returning one")
        return layers

    def layers_prefix(self) -> str:
        """The state-dict prefix of the layer sequence's weights (``"layers."`` by default)."""
        layers = self.configure_layers()
        for name, child in self.named_modules():
            if child is layers:
                return f"{name}." if name else ""
        return "layers."

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint numbering the layers (the distributed transport's, before it kept their
        names) is renamed after them, so that it loads as any other."""
        super().on_load_checkpoint(checkpoint)
        checkpoint["state_dict"] = named_after(checkpoint["state_dict"], self.configure_layers(), self.layers_prefix())

    def init_layer(self, index: int, layer: nn.Module) -> None:
        """Initialize layer ``index``, built on ``meta``, once allocated on its stage's device.

        Runs under ``torch.no_grad()`` with the generator seeded ``seed + index``. Default:
        ``reset_parameters()`` (or ``reset_running_stats()``) of every submodule; override
        it for a custom init (it must depend only on ``index`` and the layer).
        """
        reset_layer(layer)

    def loss_fn(self, outputs: Any, targets: Any) -> Tensor:
        """Loss of one slice of the batch (mean; or sum when ``loss_normalizer`` is defined)."""
        raise NotImplementedError

    loss_normalizer: Callable[[Any], Tensor | float] | None = None

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a batch; default ``batch[0], batch[1]``."""
        return batch[0], batch[1]

    def count_samples(self, inputs: Any, targets: Any) -> tuple[int, int | Tensor]:
        """(samples, tokens) in a batch, for throughput; tokens 0 when not a token task (a tensor
        count is left on its device: ``PipelineMetrics`` reads it only when it logs)."""
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        return int(first.shape[0]), 0

    def log_train(self, loss: Tensor, outputs: Any, targets: Any) -> None:
        """Log the training metrics of one mini-batch (the real loss, never a placeholder)."""
        self.log("train/loss", loss, prog_bar=True)

    # ------------------------------------------------------------ shared logic
    def forward(self, inputs: Any) -> Any:
        """The pipelined forward under a ``GPipeStrategy``, the plain layers otherwise."""
        if self.pipeline is not None:
            return self.pipeline.pipeline_forward(inputs)
        return self.configure_layers()(inputs)

    def full_batch_loss(self, outputs: Any, targets: Any) -> Tensor:
        """The loss of a whole batch, as the pipeline computes it from its slices."""
        loss = self.loss_fn(outputs, targets)
        if self.loss_normalizer is not None:
            loss = loss / float(self.loss_normalizer(targets))
        return loss

    def pipeline_loss(self, batch: Any) -> Tensor:
        """For manual optimization: forward AND backward of ``batch``; returns the real loss.

        Under a ``GPipeStrategy`` the whole schedule runs here (gradients land in the
        parameters) and ``manual_backward`` of the returned loss is a no-op; otherwise the
        loss is computed unpipelined and ``manual_backward`` back-propagates it.
        """
        if self.pipeline is not None:
            return self.pipeline.run_manual(batch)
        inputs, targets = self.split_batch(batch)
        outputs = self.configure_layers()(inputs)
        loss = self.full_batch_loss(outputs, targets)
        self.log_train(loss.detach(), outputs, targets)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """Unpipelined (automatic) or ``pipeline_loss`` + optimizer step (manual optimization).

        Under a ``GPipeStrategy`` with automatic optimization this is never called: the
        strategy runs the schedule in ``backward``.
        """
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            assert not isinstance(optimizer, list), "manual optimization here steps one optimizer"
            optimizer.zero_grad()
            loss = self.pipeline_loss(batch)
            self.manual_backward(loss)
            clip = self.trainer.gradient_clip_val
            if clip:
                self.configure_gradient_clipping(optimizer, clip, self.trainer.gradient_clip_algorithm or "norm")
            optimizer.step()
            return None
        return self.pipeline_loss(batch)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's hook; under a ``GPipeStrategy`` clipping by norm takes the norm over EVERY
        stage (in the distributed transport the stages' squared norms are summed across ranks).

        An override that calls ``self.clip_gradients`` clips each rank by its own stage's norm.
        """
        if self.pipeline is not None and gradient_clip_val and (gradient_clip_algorithm or "norm") == "norm":
            self.pipeline.clip_grad_norm(optimizer, float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def evaluate(self, batch: Any, prefix: str) -> dict[str, Tensor]:
        """Loss (and subclass metrics) of a validation / test batch through ``forward``."""
        inputs, targets = self.split_batch(batch)
        with torch.no_grad():
            outputs = self(inputs)
        loss = self.full_batch_loss(outputs, targets)
        self.log(f"{prefix}/loss", loss, prog_bar=prefix == "val", sync_dist=False)
        return {"loss": loss, "outputs": outputs, "targets": targets}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.evaluate(batch, "val")["loss"]

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.evaluate(batch, "test")["loss"]

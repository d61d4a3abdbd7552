"""One stage's compute: forward, backward and deferred weight gradients per micro-batch.

The stage does not know how tensors reach it (threads or torch.distributed):
a transport hands it inputs and gradients and ships what it returns. Backward
is explicit (``torch.autograd.backward`` on this stage's saved outputs), so
every stage runs its own backward, in parallel with the others.

Re-materialization: a checkpointed micro-batch runs its forward without
building a graph and keeps only its boundary input; its backward first replays
the forward with the same generator (identical dropout masks) and the first
forward's autocast state, restoring the running statistics the replay moves,
then back-propagates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import has_torch_function

from gpipe_lab.pipeline.measuring.device_timing import DeviceClock
from gpipe_lab.pipeline.measuring.saved_bytes import SavedBytes, storage_keys
from gpipe_lab.pipeline.measuring.step_timeline import Event
from gpipe_lab.pipeline.microbatch import as_tuple, final_output, unwrap
from gpipe_lab.pipeline.skip.layout import StageSkips
from gpipe_lab.pipeline.stage.batchnorm import running_stat_layers, running_stats_untouched
from gpipe_lab.pipeline.stage.boundary import BoundaryRecord
from gpipe_lab.pipeline.stage.checkpointing import autocast_as, autocast_state, checkpointing
from gpipe_lab.pipeline.stage.compiling import CompiledStage
from gpipe_lab.pipeline.stage.context import microbatch_seed
from gpipe_lab.pipeline.stage.input_writes import InputWrites
from gpipe_lab.pipeline.stage.memory_count import SignatureMemo, parameters_needing_grad
from gpipe_lab.pipeline.stage.module_walk import ModuleWalk, walk
from gpipe_lab.pipeline.stage.replay_policy import DISPATCH, NONE, OFF, StageReplay
from gpipe_lab.pipeline.stage.stage_state import SavedMicrobatch, StepPlan, weighted
from gpipe_lab.pipeline.stage.weight_gradients import (
    backward_into,
    batched_weight_backward,
    input_backward,
    plan_split,
    split_weight_backward,
)

#: the context of a forward whose grad mode is already the one it needs
_UNCHANGED = nullcontext()


class StageRuntime:
    """Runs the actions of partition ``index`` on ``device``."""

    def __init__(self, index: int, num_stages: int, module: nn.Sequential, device: torch.device,
                 base_seed: int) -> None:
        self.index = index
        self.num_stages = num_stages
        self.module = module
        self.device = device
        self.base_seed = base_seed
        self.is_last = index == num_stages - 1
        self.plan = StepPlan(0, 1, frozenset())
        self.mode: tuple[bool, ...] = ()  # each layer's training flag, read at the step's start
        # (stage, kind, micro-batch, start, end) per action: a plain tuple on the action's path;
        # ``executor.StepRecord`` makes the ``Event``s when the timeline is read
        self.events: list[tuple[int, str, int, float, float]] = []
        self.losses: dict[int, Tensor] = {}
        self.outputs: dict[int, tuple[tuple[Tensor, ...], bool]] = {}
        self.keep_outputs = False
        self._saved: dict[int, SavedMicrobatch] = {}
        self._param_storages: frozenset[int] | None = None
        self._params_key: Hashable | None = None
        self.memory_memo = SignatureMemo()
        self._norms: list[nn.Module] | None = None
        self._walk: ModuleWalk | None = None
        self.live_bytes = 0
        self.peak_bytes = 0
        self.track_memory: bool | str = True  # see ``memory_count``
        self.replay = StageReplay("auto", device, NONE, module, index)  # the core sets the option's
        self.clock = DeviceClock(device) if device.type == "cuda" else None
        self.compiled: CompiledStage | None = None  # set by the core with ``compile``
        self.input_writes = InputWrites(index)  # an in-place first layer (``input_writes``)
        # long skips crossing this stage: popped ones are its last inputs, stashed ones its last outputs
        self.skips: StageSkips | None = None
        self.boundary = BoundaryRecord(index)  # what it sends the next stage (``boundary``)

    # ---------------------------------------------------------------- step
    def begin(self, plan: StepPlan, keep_outputs: bool = False) -> None:
        """Reset per-step state; call before the first action of a step."""
        self.plan = plan
        self.keep_outputs = keep_outputs
        self.events = []
        self.losses = {}
        self.outputs = {}
        self._saved = {}
        self.live_bytes = self.peak_bytes = 0
        if self.clock is not None:
            self.clock.begin()
        self._walk = None  # the step's one walk of the module, made when first needed
        self._param_storages = self._params_key = None  # made when a forward of the step first needs them
        self._norms = None  # found at the step's first replay
        # the layers' modes, read once per step: ``pipe.eval()`` (or a framework's ``model.eval()``,
        # which reaches only the layers) leaves this stage's own container as it was, and each
        # mode's first step is its random-draw probe (``replay_policy``)
        self.mode = tuple(layer.training for layer in self.module.children())
        self.module.training = any(self.mode)
        self.replay.settle()

    def abort(self) -> None:
        """Free what a failed step left behind."""
        for saved in self._saved.values():
            saved.clear()
        self._saved = {}
        self.live_bytes = 0

    def live_microbatches(self) -> int:
        """Micro-batches whose forward state this stage still holds (awaiting their backward)."""
        return len(self._saved)

    def step_walk(self) -> ModuleWalk:
        """The module's modules, parameters and buffers, walked once per step (``module_walk``)."""
        if self._walk is None:
            self._walk = walk(self.module)
        return self._walk

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def _start(self) -> tuple[float, Any]:
        """Host time and (on a GPU) a device event at an action's start."""
        return time.perf_counter(), None if self.clock is None else self.clock.start()

    def _record(self, kind: str, mb: int, start: tuple[float, Any]) -> None:
        self.events.append((self.index, kind, mb, start[0], time.perf_counter()))
        if self.clock is not None:
            self.clock.stop(kind, (mb,), start[1])

    def device_events(self) -> list[Event]:
        """The last step's actions timed on the device (GPU stages; waits for it once), else []."""
        return [] if self.clock is None else self.clock.resolve(self.index)

    def _add_bytes(self, n: int) -> None:
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _run(self, mb: int, inputs: tuple[Tensor, ...], was_tensor: bool, target: object,
             recomputing: bool) -> tuple[tuple[Tensor, ...], bool]:
        """Apply the partition (and the loss on the last stage), counting saved bytes."""
        saved = self._saved[mb]
        def count(n: int) -> None:
            saved.saved_bytes += n
            self._add_bytes(n)

        counter, signature = self._memory_counter(inputs, target, recomputing, mb, count)
        hooks = nullcontext() if counter is None else counter.hooks()
        # every micro-batch gets its generator: any layer may draw from current_generator()
        seed = microbatch_seed(self.base_seed, self.plan.step, self.index, mb)
        if not recomputing:
            saved.replay = self.replay.first_kind(self.mode)
        kind = OFF if recomputing and saved.replay == DISPATCH and saved.drew_nothing else saved.replay
        skips, frame = self.skips, None
        if skips is not None:  # the popped skips leave the inputs for the layers' stash / pop
            inputs, frame = skips.frame(inputs)
        with self.replay.forward(kind, seed, recomputing, self.mode) as mode, hooks, \
                checkpointing(mb in self.plan.checkpointed and not recomputing):
            x = unwrap(inputs, was_tensor)
            # the module is read at each call: a front end may wrap it (autocast) after construction
            if frame is None:
                out = self.module(x) if self.compiled is None else self.compiled(self.module, x)
            else:
                out = frame.run(self.module if self.compiled is None else partial(self.compiled, self.module), x)
            out_is_tensor = isinstance(out, Tensor)
            if not self.is_last:  # (the label is formatted only for a value that is not a tensor)
                outputs = (out,) if out_is_tensor else as_tuple(
                    out, f"partition {self.index} output (micro-batch {mb})")
                if skips is not None and frame is not None:
                    outputs += skips.outputs(frame, mb)
            elif self.plan.loss_fn is None or (self.keep_outputs and not recomputing):
                outputs = final_output(out, mb)
            if self.is_last and self.plan.loss_fn is not None:
                loss = self.plan.loss_fn(out, target)  # any value loss_fn reads, a dict included
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                                    f"of shape {getattr(loss, 'shape', None)}")
                scaled = weighted(loss.reshape(()), self.plan.loss_weights[mb])
                if not recomputing:
                    self.losses[mb] = scaled.detach()
                    if self.keep_outputs:
                        self.outputs[mb] = (tuple(t.detach() for t in outputs), out_is_tensor)
                outputs, out_is_tensor = (scaled,), True
            elif self.is_last and self.keep_outputs and not recomputing:
                self.outputs[mb] = (tuple(t.detach() for t in outputs), out_is_tensor)
        if mode is not None and not recomputing:
            saved.drew_nothing = mode.draws == 0
        if signature is not None and counter is not None:  # (a signature comes with a counter)
            self.memory_memo.remember(signature, counter.total)
        return outputs, out_is_tensor

    def _memory_counter(self, inputs: tuple[Tensor, ...], target: object, recomputing: bool, mb: int,
                        count: Callable[[int], None]) -> tuple[SavedBytes | None, Hashable | None]:
        """The counter for this forward's saved bytes (None: not counted), and the signature to
        remember its count under (None: nothing to remember). A forward whose signature was
        counted before is charged that count here (``memory_count``)."""
        if not self.track_memory:
            return None, None
        signature = None
        if self.track_memory is True:
            if self._params_key is None:
                self._params_key = parameters_needing_grad(self.step_walk().parameters)
            loss = (self.plan.loss_fn, target) if self.is_last and self.plan.loss_fn is not None else None
            signature = self.memory_memo.signature(self.module, self._params_key, inputs, recomputing,
                                                   mb in self.plan.checkpointed and not recomputing, loss)
            known = self.memory_memo.known(signature)
            if known is not None:
                count(known)
                return None, None
        if self._param_storages is None:
            found = self.step_walk()
            self._param_storages = storage_keys([*found.parameters, *found.buffers])
        # boundary inputs are counted on their own; the rule is the lab's one (gpipe_lab.pipeline.measuring.saved_bytes)
        return SavedBytes(self._param_storages, inputs, count), signature

    # ---------------------------------------------------------------- actions
    def forward(self, mb: int, inputs: tuple[Tensor, ...], was_tensor: bool,
                target: object = None) -> tuple[tuple[Tensor, ...], bool]:
        """Forward of one micro-batch; returns (outputs, outputs-were-a-tensor)."""
        start = self._start()
        grad = self.plan.grad_enabled
        own_input_grads = True
        if self.index > 0 and grad:
            inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
        elif grad and (self.index, mb) in self.plan.split_backward and not any(t.requires_grad for t in inputs):
            # the first stage of a split schedule: a leaf input bounds the graph, so B can carry
            # the input-side gradients through the stage and leave every weight GEMM to W
            inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
            own_input_grads = False
        saved = SavedMicrobatch(inputs, was_tensor, target, own_input_grads=own_input_grads)
        self._saved[mb] = saved
        self._add_bytes(sum(t.numel() * t.element_size() for t in inputs))
        checkpointed = mb in self.plan.checkpointed
        if checkpointed:
            saved.autocast = autocast_state()
        run, versions = self.input_writes.prepare(inputs, checkpointed) if grad else (inputs, None)
        graph = grad and not checkpointed
        # the mode is thread-local and a stage thread's is mostly already the one wanted: no switch then
        with _UNCHANGED if torch.is_grad_enabled() == graph else torch.set_grad_enabled(graph):
            outputs, out_is_tensor = self._run(mb, run, was_tensor, target, recomputing=False)
        if versions is not None:
            self.input_writes.learn(run, versions, (self.plan.step, mb))
        if not grad:
            self._release(mb)  # forward only: nothing is kept for a backward
        elif not checkpointed:
            saved.outputs = outputs
        self._record("F", mb, start)
        return outputs, out_is_tensor

    def rematerialize(self, mb: int) -> None:
        """Replay a checkpointed micro-batch's forward (a no-op if its graph is alive).

        Transports call this before waiting for the gradient, so the recompute
        overlaps the wait (the paper schedules re-computation early for this reason).
        """
        saved = self._saved[mb]
        if saved.outputs is None:
            start = self._start()
            # the replay sees its first forward's state: autocast as then, running statistics not moved again
            if self._norms is None:
                self._norms = running_stat_layers(self.step_walk().modules)
            with torch.enable_grad(), autocast_as(saved.autocast), running_stats_untouched(self._norms):
                saved.outputs, _ = self._run(mb, self.input_writes.replay_inputs(saved.inputs), saved.was_tensor,
                                             saved.target, recomputing=True)
            self._record("R", mb, start)

    def backward(self, mb: int, grads: tuple[Tensor | None, ...] | None) -> tuple[Tensor | None, ...]:
        """Backward of one micro-batch; returns the gradient of each stage input."""
        saved = self._saved[mb]
        if saved.outputs is None:
            self.rematerialize(mb)
        start = self._start()
        tensors, grad_tensors = self._backward_pairs(saved.outputs, grads)
        leaves = [t for t in saved.inputs if t.requires_grad and t.is_leaf]
        if (self.index, mb) in self.plan.split_backward:
            saved.grads = grads
            params = [p for p in self.step_walk().parameters if p.requires_grad]
            saved.split = plan_split(tensors, leaves, params) if tensors else None
            found: list[Tensor | None] | tuple[Tensor | None, ...] = []
            if saved.split is not None:  # cheap W: B captures each weight layer's grad_output
                found = input_backward(saved.split, tensors, grad_tensors, leaves, saved.own_input_grads)
            elif tensors and leaves and saved.own_input_grads:
                found = torch.autograd.grad(tensors, leaves, grad_tensors, retain_graph=True,
                                            allow_unused=True)
            for leaf, g in zip(leaves, found):
                if g is not None:  # accumulate: the caller's own leaf may hold a gradient already
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
        elif tensors:
            stage_backward(tensors, grad_tensors)
        result = tuple(t.grad if t.requires_grad and t.is_leaf else None for t in saved.inputs)
        if (self.index, mb) not in self.plan.split_backward:
            self._release(mb)
        self._record("B", mb, start)
        return result

    def weight_backward(self, mb: int) -> None:
        """Deferred weight gradients of a micro-batch whose B ran with split backward.

        Consecutive ``W`` actions of this stage (``plan.weight_runs``) run together at
        the last one, ``nn.Linear`` layers as one GEMM over all their micro-batches.

        Cheap path (see ``weight_gradients``): only the weight-side outputs of the
        layers that own parameters, from the ``grad_output`` captured in B. Fallback
        (tied weights inside a stage, no input gradient): a backward over the graph
        with ``inputs=params``, exact but repeating B's work.
        """
        run = self.plan.weight_runs.get(self.index, {}).get(mb, (mb,))
        if mb != run[-1]:
            return  # done with the rest of its run, at the run's last W
        start, device_start = self._start()
        saved = [self._saved[m] for m in run]
        splits = [s.split for s in saved if s.split is not None]
        if len(splits) > 1:
            batched_weight_backward(splits)
        elif splits:
            split_weight_backward(splits[0])
        for s in saved:
            if s.split is None:
                tensors, grad_tensors = self._backward_pairs(s.outputs, s.grads)
                params = [p for p in self.step_walk().parameters if p.requires_grad]
                if tensors and params:
                    backward_into(tensors, grad_tensors, params)
        end = time.perf_counter()
        if self.clock is not None:
            self.clock.stop("W", tuple(run), device_start)
        for i, m in enumerate(run):  # one event per micro-batch: an equal share of the run's time
            self._release(m)
            self.events.append((self.index, "W", m, start + (end - start) * i / len(run),
                                start + (end - start) * (i + 1) / len(run)))

    def _backward_pairs(self, outputs: tuple[Tensor, ...] | None,
                        grads: tuple[Tensor | None, ...] | None) -> tuple[list[Tensor], list[Tensor] | None]:
        assert outputs is not None
        if self.is_last and self.plan.loss_fn is not None:
            return [outputs[0]], None
        if grads is None:
            raise RuntimeError(f"stage {self.index} got no gradient for its outputs")
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _release(self, mb: int) -> None:
        saved = self._saved.pop(mb)
        self.live_bytes -= saved.saved_bytes + sum(t.numel() * t.element_size() for t in saved.inputs)
        saved.clear()


# A stage's backward call: ``torch.autograd.backward`` less its per-call Python argument handling.
#
# Every B action of every stage calls the autograd engine once. ``torch.autograd.backward``
# first normalizes its arguments in Python (tuples, ``__torch_function__`` dispatch,
# ``_make_grads``' shape checks, which walk each shape symbolically): on layers whose kernels
# take microseconds that is a large share of an action. The stage's call always has the same
# form (outputs that require grad, their gradients from the next stage, or one scalar
# loss), and the C++ engine validates each gradient against its output's shape, dtype and
# device itself, so this goes straight to the engine's entry that ``torch.autograd.backward``
# ends in (``torch.autograd.graph._engine_run_backward``, which keeps its TLS context and
# debug-logging hooks). Anything else, and any torch without that entry, takes the public call.
_engine_run_backward = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)


def stage_backward(tensors: Sequence[Tensor], grads: Sequence[Tensor] | None) -> None:
    """``torch.autograd.backward(tensors, grads)``: gradients accumulate into the leaves' ``.grad``.

    ``grads=None``: each tensor is a one-element output (a loss) whose gradient is one.

    Raises:
        RuntimeError: whatever the engine raises (a gradient of the wrong shape, a graph
            already freed, ...); as ``torch.autograd.backward`` for ``grads=None`` on a tensor
            of more than one element.
    """
    tensors = tuple(tensors)
    if _engine_run_backward is None or has_torch_function(tensors) or (
            grads is not None and has_torch_function(tuple(grads))):
        torch.autograd.backward(tensors, grads)
        return
    if grads is None:
        if any(t.numel() != 1 for t in tensors):
            torch.autograd.backward(tensors)  # raises torch's own error
            return
        grads = [torch.ones_like(t, memory_format=torch.preserve_format) for t in tensors]
    _engine_run_backward(tensors, tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)

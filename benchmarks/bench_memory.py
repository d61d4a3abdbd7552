"""Memory, counted deterministically: saved activations, parameters and optimizer state per stage.

Measured: ``GPipe.memory()`` after one step (saved-tensor hooks; the peak of the
bytes a stage holds for backward). Model (the paper's O(N + (L/K)·(N/M))), from
shapes alone:

    boundary  = bytes of stage k's input for the whole mini-batch (all M micro-batches)
    internals = bytes autograd saves inside stage k for ONE micro-batch
                (counted on the meta device with the same hooks)
    always    ≈ boundary + internals          never (GPipe) ≈ M · (input_mb + internals)

Optimizer state: Adam keeps 2 tensors per parameter, SGD with momentum 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.saved_bytes import SavedBytes, storage_keys
from gpipe_lab.planner.workload import Workload

K = 2


def _tuple(value: object) -> tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)  # type: ignore[return-value]


def _nbytes(values: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in values)


def saved_bytes(part: nn.Module, inputs: object, last: bool, work: Workload, target: Tensor) -> int:
    """Activation bytes autograd saves when ``part`` (+ loss if ``last``) runs, by the engine's rule
    (``gpipe_lab.pipeline.measuring.saved_bytes``: parameters excluded, each distinct view once by its own elements)."""
    counter = SavedBytes(storage_keys(part.parameters()))
    with torch.enable_grad(), counter.hooks():
        out = part(inputs)
        if last:
            work.loss_fn(out, target)
    return counter.total


def memory_model(work: Workload, chunks: int) -> list[dict[str, int]]:
    """Per stage: boundary bytes (all micro-batches) and one micro-batch's internal saved bytes."""
    value: object = work.inputs
    target = work.targets
    mb_size = -(-work.targets.shape[0] // chunks)
    result, start = [], 0
    for k, n in enumerate(work.balance):
        part = work.module[start:start + n]
        start += n
        full = _tuple(value)
        boundary = _nbytes(full)
        mb = tuple(t[:mb_size] for t in full)
        mb_in = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in mb)
        internals = saved_bytes(part, mb_in if isinstance(value, tuple) else mb_in[0],
                                         k == len(work.balance) - 1, work, target[:mb_size])
        result.append({"boundary_bytes": boundary, "input_mb_bytes": _nbytes(mb), "internal_mb_bytes": internals,
                       "model_always_bytes": boundary + internals,
                       "model_never_gpipe_bytes": chunks * (_nbytes(mb) + internals)})
        with torch.no_grad():
            value = part(value)
    return result


def mlp_closed_form(batch: int, width: int, hidden: int, blocks_per_stage: int, chunks: int,
                    last: bool) -> int:
    """The 'always' model for the MLP by hand: inputs of all micro-batches + one micro-batch's internals.

    Per block, autograd keeps Linear-1's input (width), GELU's input (hidden) and
    Linear-2's input (hidden); MSE keeps its input and target (width each).
    """
    mb = batch // chunks
    internals = blocks_per_stage * mb * (width + 2 * hidden) * 4 + (2 * mb * width * 4 if last else 0)
    return batch * width * 4 + internals


def measure(work: Workload, chunks: int, checkpoint: str, schedule: str, device: str) -> list[dict[str, int]]:
    """``pipe.memory()`` after one training step."""
    pipe = GPipe(work.module, balance=work.balance, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                 devices=[device] * K, threads_per_stage=1, seed=0)
    pipe.train_step(work.inputs, work.targets, work.loss_fn)
    work.module.zero_grad(set_to_none=True)
    return pipe.memory()


def run_memory(work: Workload, chunks: Sequence[int], device: str,
               checkpoints: Sequence[str] = ("never", "except_last", "always")) -> dict[str, object]:
    """Measured vs modelled saved-activation peaks, and parameter / optimizer bytes per stage."""
    rows = []
    params: list[int] = []  # parameter bytes per stage, from the first step measured
    for m in chunks:
        if m > work.targets.shape[0]:
            continue
        model = memory_model(work, m)
        for schedule in ("gpipe", "1f1b"):
            for checkpoint in checkpoints:
                stages = measure(work, m, checkpoint, schedule, device)
                params = params or [s["parameter_bytes"] for s in stages]
                for k, (s, mod) in enumerate(zip(stages, model)):
                    ref = mod["model_always_bytes"] if checkpoint == "always" else (
                        mod["model_never_gpipe_bytes"] if checkpoint == "never" and schedule == "gpipe" else None)
                    rows.append({"M": m, "schedule": schedule, "checkpoint": checkpoint, "stage": k,
                                 "peak_activation_bytes": s["peak_activation_bytes"], "model_bytes": ref,
                                 "ratio_to_model": None if not ref else s["peak_activation_bytes"] / ref})
    params = params or [p["parameter_bytes"] for p in measure(work, 1, "never", "gpipe", device)]
    per_stage = [{"stage": k, "parameter_bytes": b, "gradient_bytes": b, "adam_state_bytes": 2 * b,
                  "sgd_momentum_state_bytes": b} for k, b in enumerate(params)]
    return {"activations": rows, "parameters": per_stage,
            "model": {str(m): memory_model(work, m) for m in chunks if m <= work.targets.shape[0]}}

"""Run a ``Case`` through the engine and through plain PyTorch on the same micro-batches.

The reference is the same model unpipelined, on the same micro-batches: each
micro-batch's forward, its loss weighted by its share of the batch, one backward.
Random layers cannot match PyTorch's global generator, so the reference draws as
the engine promises to: micro-batch i's layers of stage j run inside
``microbatch_context`` with the generator seeded ``microbatch_seed(seed, step, j, i)``
(every call of the pipe, with or without backward, is one step), and ``nn.Dropout``
is swapped for ``StageDropout`` as the engine swaps it. Deferred BatchNorm's
running statistics are those of one ``nn.BatchNorm`` update from the whole
mini-batch's inputs to that layer.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from differential_cases import (
    BALANCE,
    PROBE_LAYER,
    SEED,
    Case,
    input_tensors,
    loss_fn,
    make_batch,
    make_model,
)
from differential_compare import bitwise_differences, differences
from torch import nn

from gpipe_lab.pipeline import GPipe, checkpointed_microbatches, convert_dropout
from gpipe_lab.pipeline.context import microbatch_context, microbatch_seed
from gpipe_lab.pipeline.distributed import DistributedGPipe

Observed = dict[str, object]


def _autocast(case: Case) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.autocast == "bf16" else contextlib.nullcontext()


def _state(model: nn.Module, x: object, obs: Observed) -> Observed:
    """Gradients and buffers (those held here: another rank's layers are on ``meta``)."""
    obs["grads"] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
                    if not p.is_meta}
    obs["input_grad"] = [None if t.grad is None else t.grad.clone() for t in input_tensors(x)
                         if t.is_floating_point()]
    params = dict(model.named_parameters())
    obs["buffers"] = {n: b.clone() for n, b in model.state_dict().items() if n not in params and not b.is_meta}
    return obs


def run_engine(case: Case) -> Observed:
    """What a user sees after one call (``train_step``, ``pipe(x)`` + backward) or two (no_grad).

    ``obs["error"]`` holds the message of an error the engine raised instead.
    """
    model = make_model(case)
    x, y = make_batch(case)
    obs: Observed = {}
    try:
        options = dict(balance=BALANCE[case.K], chunks=case.M, checkpoint=case.checkpoint,
                       schedule=case.schedule, deferred_batch_norm=case.bn == "deferred", seed=SEED, timeout=60,
                       track_memory=case.track_memory)
        if case.transport == "local":
            pipe = GPipe(model, threads_per_stage=1, **options)
        else:  # this rank's share; differential_distributed merges the ranks'
            pipe = DistributedGPipe(model, **options)
        if case.door == "train_step":
            with _autocast(case):
                if case.output == "tensor":
                    loss, out = pipe.train_step(x, y, loss_fn, return_outputs=True)
                    obs["outputs"] = [out]
                else:
                    loss = pipe.train_step(x, y, loss_fn)
            obs["loss"] = loss
        elif case.door == "backward":
            with _autocast(case):
                out = pipe(x)
                loss = loss_fn(out, y)
            obs["outputs"], obs["loss"] = [out.detach()], loss.detach()
            loss.backward()  # outside autocast, as PyTorch's AMP recipe does
        else:
            pipe.train(case.door == "nograd_train")
            with torch.no_grad(), _autocast(case):
                obs["outputs"] = [pipe(x), pipe(x)]
    except (TypeError, ValueError, RuntimeError) as exc:
        obs["error"] = f"{type(exc).__name__}: {exc}"
        return obs
    obs["probe"] = sorted(model[PROBE_LAYER].seen)
    return _state(model, x, obs)


@contextlib.contextmanager
def _deferred_statistics(model: nn.Module) -> Iterator[None]:
    """Let the BatchNorms run per micro-batch, then give them one update from the whole batch."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    before = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in norms]
    seen: dict[int, list[torch.Tensor]] = {id(m): [] for m in norms}
    hooks = [m.register_forward_pre_hook(lambda m, a: seen[id(m)].append(a[0].detach())) for m in norms]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for m, (mean, var, count) in zip(norms, before):
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.copy_(count)
            if seen[id(m)] and m.training:
                whole = torch.cat(seen[id(m)]).double()
                mom = m.momentum
                m.running_mean.mul_(1 - mom).add_((whole.mean(0) * mom).to(mean.dtype))
                m.running_var.mul_(1 - mom).add_((whole.var(0, unbiased=True) * mom).to(var.dtype))
                m.num_batches_tracked += 1


def _forward(case: Case, stages: list[nn.Sequential], x: object, step: int) -> torch.Tensor | dict:
    """The model on micro-batches of ``x``, each stage drawing from the engine's generators."""
    parts = [torch.tensor_split(t, case.M) for t in input_tensors(x)]
    outs = []
    for i in range(case.M):
        h: object = tuple(p[i] for p in parts) if isinstance(x, tuple) else parts[0][i]
        for j, stage in enumerate(stages):
            gen = torch.Generator().manual_seed(microbatch_seed(SEED, step, j, i))
            with microbatch_context(gen):
                h = stage(h)
        outs.append(h)
    return outs  # type: ignore[return-value]


def _accumulate(outs: list, loss: torch.Tensor) -> None:
    """Back-propagate ``loss`` one micro-batch at a time (last first), as gradient accumulation
    does: under autocast the 16-bit weight copy is shared by the micro-batches, and one
    backward would sum their gradients in 16 bits before the cast back."""
    tensors = [o["y"] if isinstance(o, dict) else o for o in outs]
    grads = torch.autograd.grad(loss, tensors)
    for t, g in reversed(list(zip(tensors, grads))):
        t.backward(g)


def run_reference(case: Case) -> Observed:
    """Plain PyTorch on the same micro-batches (see the module docstring)."""
    model = make_model(case)
    convert_dropout(model)
    x, y = make_batch(case)
    layers = list(model)
    starts = [sum(BALANCE[case.K][:j]) for j in range(case.K)]
    stages = [nn.Sequential(*layers[s:s + n]) for s, n in zip(starts, BALANCE[case.K])]
    deferred = _deferred_statistics(model) if case.bn == "deferred" else contextlib.nullcontext()
    obs: Observed = {}
    if case.trains:
        with deferred:
            with _autocast(case):
                outs = _forward(case, stages, x, 0)
                targets = torch.tensor_split(y, case.M)
                loss = sum(loss_fn(o, t) * (t.shape[0] / case.batch) for o, t in zip(outs, targets))
                if case.door == "backward" and case.output == "tensor":
                    loss = loss_fn(torch.cat(outs), y)
            _accumulate(outs, loss)
        obs["loss"] = loss.detach()
        if case.output == "tensor":
            obs["outputs"] = [torch.cat([o.detach() for o in outs])]
    else:
        model.train(case.door == "nograd_train")
        obs["outputs"] = []
        for step in (0, 1):
            with _deferred_statistics(model) if case.bn == "deferred" else contextlib.nullcontext():
                with torch.no_grad(), _autocast(case):
                    obs["outputs"].append(torch.cat(_forward(case, stages, x, step)))
    obs["probe"] = expected_probe(case)
    return _state(model, x, obs)


def expected_probe(case: Case) -> list[tuple[bool, bool]]:
    """torchgpipe's rule: (True, False) in a checkpointed forward, (False, True) in its replay."""
    if not case.trains:
        return [(False, False)] * (2 * case.M)
    ck = checkpointed_microbatches(case.checkpoint, case.M)
    return sorted([(i in ck, False) for i in range(case.M)] + [(False, True)] * len(ck))


def expected_error(case: Case) -> str | None:
    """The clear error a combination must raise instead of running (a regex), or None."""
    if case.output == "dict" and case.door != "train_step":
        return r"last partition's output .* dict"
    if case.door == "backward" and case.transport == "distributed":
        return r"cannot back-propagate pipe\(x\) across processes"
    if case.door == "backward" and case.schedule != "gpipe":
        return r"needs the loss inside the pipeline"
    return None


def judge(case: Case, got: Observed, again: Observed | None) -> list[str]:
    """What is wrong with the engine's two runs of ``case`` (``again`` None: run it again
    here): the clear error it must raise, or every observable against plain PyTorch and
    the second run bit for bit. Empty when the case passes."""
    pattern = expected_error(case)
    if pattern is not None:
        if re.search(pattern, got.get("error", "")):  # type: ignore[arg-type]
            return []
        return [f"expected an error matching {pattern!r}, got {got.get('error', 'no error')}"]
    if "error" in got:
        return [str(got["error"])]
    return differences(case, got, run_reference(case)) + bitwise_differences(got, again or run_engine(case))


__all__ = ["Observed", "expected_error", "judge", "run_engine", "run_reference"]

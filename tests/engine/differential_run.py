"""Run a ``Case`` through the engine and through plain PyTorch on the same micro-batches.

The reference is the same model unpipelined, on the same micro-batches: each
micro-batch's forward, its loss weighted by its share of the batch, one backward.
Random layers cannot match PyTorch's global generator, so the reference draws as
the engine promises to: micro-batch i's layers of stage j run inside
``microbatch_context`` with the generator seeded ``microbatch_seed(seed, step, j, i)``
(every call of the pipe, with or without backward, is one step), and ``nn.Dropout``
is swapped for ``StageDropout`` as the engine swaps it. Deferred BatchNorm's
running statistics are those of one ``nn.BatchNorm`` update from the whole
mini-batch's inputs to that layer. A zoo model's case runs a script of calls
(``script``: its transition) on both sides, with the cut ``balance_of`` gives.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch
from differential_cases import (
    PROBE_LAYER,
    SEED,
    Case,
    balance_of,
    input_tensors,
    loss_fn,
    make_batch,
    make_model,
    make_zoo,
    make_zoo_batch,
    one_thread,
    steps,
    virtual_stages_of,
)
from differential_compare import bitwise_differences, differences
from torch import nn

from gpipe_lab.pipeline import GPipe, checkpointed_microbatches, convert_dropout
from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.stage.context import microbatch_context, microbatch_seed
from helpers import zoo

Observed = dict[str, object]
# what a case's run records as its outcome instead of raising (the engine's own errors are of these kinds)
ERRORS = (TypeError, ValueError, RuntimeError, FloatingPointError, TimeoutError)
# the size of the zoo's weight update between steps, and the clipping after the last step
STEP_SIZE, MAX_NORM = 0.01, 0.5


def _autocast(case: Case) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.autocast == "bf16" else contextlib.nullcontext()


def _state(model: nn.Module, x: object, obs: Observed) -> Observed:
    """Gradients and buffers (those held here: another rank's layers are on ``meta``); a sparse
    gradient as its dense value, its name in ``obs["sparse"]``."""
    grads = {n: p.grad for n, p in model.named_parameters() if not p.is_meta}
    obs["sparse"] = sorted(n for n, g in grads.items() if g is not None and g.is_sparse)
    obs["grads"] = {n: None if g is None else (g.to_dense() if g.is_sparse else g.clone()) for n, g in grads.items()}
    obs["input_grad"] = [None if t.grad is None else t.grad.clone() for t in input_tensors(x)
                         if t.is_floating_point()]
    params = dict(model.named_parameters())
    obs["buffers"] = {n: b.clone() for n, b in model.state_dict().items() if n not in params and not b.is_meta}
    return obs


def make_pipe(case: Case, layers: nn.Sequential) -> GPipe | DistributedGPipe:
    """The engine over ``layers`` with ``case``'s options: ``GPipe``, or this rank's share of a
    ``DistributedGPipe`` (``differential_distributed`` merges the ranks' observations)."""
    options = dict(balance=balance_of(case), chunks=case.M, checkpoint=case.checkpoint, schedule=case.schedule,
                   virtual_stages=virtual_stages_of(case),
                   deferred_batch_norm=case.bn == "deferred", seed=SEED, timeout=60, track_memory=case.track_memory)
    if case.transport == "local":
        return GPipe(layers, threads_per_stage=1, **options)
    return DistributedGPipe(layers, **options)


def run_engine(case: Case) -> Observed:
    """What a user sees after one call (``train_step``, ``pipe(x)`` + backward) or two (no_grad).

    ``obs["error"]`` holds the message of an error the engine raised instead.
    """
    if case.model != "lab":
        return run_zoo_engine(case)
    model = make_model(case)
    x, y = make_batch(case)
    obs: Observed = {}
    try:
        pipe = make_pipe(case, model)
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
    except ERRORS as exc:
        obs["error"] = f"{type(exc).__name__}: {exc}"
        return obs
    obs["probe"] = sorted(model[PROBE_LAYER].seen)
    return _state(model, x, obs)


@contextlib.contextmanager
def _deferred_statistics(model: nn.Module) -> Iterator[None]:
    """Let the BatchNorms run per micro-batch, then give them one update from the whole batch."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
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
                whole = torch.cat(seen[id(m)]).double().transpose(0, 1).flatten(1)  # channels x values
                mom = m.momentum
                m.running_mean.mul_(1 - mom).add_((whole.mean(1) * mom).to(mean.dtype))
                m.running_var.mul_(1 - mom).add_((whole.var(1, unbiased=True) * mom).to(var.dtype))
                m.num_batches_tracked += 1


def _forward(stages: list[nn.Sequential], x: object, step: int, m: int) -> list:
    """The model on ``m`` micro-batches of ``x``, each stage drawing from the engine's generators."""
    parts = [torch.tensor_split(t, m) for t in input_tensors(x)]
    outs = []
    for i in range(m):
        h: object = tuple(p[i] for p in parts) if isinstance(x, tuple) else parts[0][i]
        for j, stage in enumerate(stages):
            gen = torch.Generator().manual_seed(microbatch_seed(SEED, step, j, i))
            with microbatch_context(gen):
                h = stage(h)
        outs.append(h)
    return outs


def _accumulate(outs: list, loss: torch.Tensor) -> None:
    """Back-propagate ``loss`` one micro-batch at a time (last first), as gradient accumulation
    does: under autocast the 16-bit weight copy is shared by the micro-batches, and one
    backward would sum their gradients in 16 bits before the cast back."""
    tensors = [o["y"] if isinstance(o, dict) else o for o in outs]
    grads = torch.autograd.grad(loss, tensors)
    for t, g in reversed(list(zip(tensors, grads))):
        t.backward(g)


def _stages(case: Case, layers: nn.Sequential) -> list[nn.Sequential]:
    """The layers cut as the engine cuts them (the stage of a layer picks its generators)."""
    balance = balance_of(case)
    return [layers[sum(balance[:j]):sum(balance[:j + 1])] for j in range(len(balance))]


def run_reference(case: Case) -> Observed:
    """Plain PyTorch on the same micro-batches (see the module docstring)."""
    if case.model != "lab":
        return run_zoo_reference(case)
    model = make_model(case)
    convert_dropout(model)
    x, y = make_batch(case)
    stages = _stages(case, model)
    deferred = _deferred_statistics(model) if case.bn == "deferred" else contextlib.nullcontext()
    obs: Observed = {}
    if case.trains:
        with deferred:
            with _autocast(case):
                outs = _forward(stages, x, 0, case.M)
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
                    obs["outputs"].append(torch.cat(_forward(stages, x, step, case.M)))
    obs["probe"] = expected_probe(case)
    return _state(model, x, obs)


def script(case: Case) -> list[tuple]:
    """A zoo case's calls, in order (``transition`` around the door): ``("train", n)`` a training
    step on the batch's first n rows (``train_short``: its targets of half as many rows),
    ``("forward", training)`` a ``no_grad`` forward in that mode, ``("update",)`` the weights moved,
    ``("freeze", bool)`` the first layer frozen or not, ``("clip",)`` the gradients clipped."""
    n = case.batch
    if not case.trains:
        return [("forward", case.door == "nograd_train")] * 2
    if not steps(case):
        return [("train", n)]  # refused
    return {
        "none": [("train", n)],
        "eval_train_eval": [("forward", False), ("train", n), ("forward", False)],
        "nograd_between": [("train", n), ("update",), ("forward", True), ("train", n)],
        "freeze": [("train", n), ("update",), ("freeze", True), ("train", n), ("update",), ("freeze", False),
                   ("train", n)],
        "batch_change": [("train", n), ("update",), ("train", n - 1)],
        "short_targets": [("train_short", n)],
    }[case.transition] + [("clip",)]


def whole_model(model: zoo.Zoo) -> nn.Module:
    """The zoo model's parameters and buffers, its front end's too."""
    parts = {"layers": model.layers} if model.front is None else {"front": model.front, "layers": model.layers}
    return nn.ModuleDict(parts)


def _prepare_grads(whole: nn.Module, how: str, first: bool) -> None:
    """``.grad`` before a training step: None, zeros, or (``accumulated``) left as it is, random
    before the first step (seeded per parameter, the same on every rank)."""
    for i, p in enumerate(whole.parameters()):
        if p.is_meta or (how == "accumulated" and not first):
            continue
        if how == "none":
            p.grad = None
        elif how == "zero":
            p.grad = torch.zeros_like(p)
        else:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(SEED + i), dtype=p.dtype)


def _update(whole: nn.Module, count: int) -> None:
    """An optimizer's step between steps, the same bits on both sides: every weight moves by a seeded
    random amount (moving it by its gradient would carry the gradients' float32 rounding into the
    next step, which a BatchNorm over a one-sample micro-batch amplifies past the tolerance)."""
    with torch.no_grad():
        for i, p in enumerate(whole.parameters()):
            if not p.is_meta:
                gen = torch.Generator().manual_seed(SEED + 1000 * count + i)
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype), alpha=STEP_SIZE)


def _whole_loss(model: zoo.Zoo, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = model.loss_fn(out, y)
    return loss / model.normalizer(y) if model.normalizer is not None else loss


def _run_script(case: Case, model: zoo.Zoo, x: torch.Tensor, y: torch.Tensor,
                train: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, object]],
                forward: Callable[[torch.Tensor, bool], object], clip: Callable[[], torch.Tensor]) -> Observed:
    """The script's calls, a step being ``train(inputs, targets)`` -> (loss, outputs) or
    ``forward(inputs, training)`` -> outputs, on the engine or the reference."""
    whole = whole_model(model)
    obs: Observed = {"outputs": [], "probe": []}
    losses, trained, updates = [], 0, 0
    for op, *arg in script(case):
        if op in ("train", "train_short"):
            _prepare_grads(whole, case.grads, first=not trained)
            trained += 1
            n = arg[0]
            ys = y[:n // 2] if op == "train_short" else y[:n]
            inputs = model.front(x[:n]) if model.front is not None else x[:n]
            loss, out = train(inputs, ys)
            losses.append(loss.detach())
            obs["outputs"].append(None if out is None else out.detach())  # type: ignore[union-attr]
        elif op == "forward":
            with torch.no_grad():
                inputs = model.front(x) if model.front is not None else x
                obs["outputs"].append(forward(inputs, arg[0]))  # type: ignore[union-attr]
        elif op == "update":
            updates += 1
            _update(whole, updates)
        elif op == "freeze":
            model.layers[0].requires_grad_(not arg[0])
        else:
            obs["norm"] = clip()
    if losses:
        obs["loss"] = torch.stack(losses)
    return _state(whole, x, obs)


def run_zoo_engine(case: Case) -> Observed:
    """A zoo case's script through the engine (``run_engine``'s zoo half)."""
    model = make_zoo(case)
    x, y = make_zoo_batch(case, model)
    x.requires_grad_(case.inputs == "grad_input")
    try:
        pipe = make_pipe(case, model.layers)

        def train(inputs: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, object]:
            if case.door == "train_step":
                return pipe.train_step(inputs, ys, model.loss_fn, loss_normalizer=model.normalizer,
                                       return_outputs=True)
            out = pipe(inputs)
            loss = _whole_loss(model, out, ys)
            loss.backward()
            return loss, out

        def forward(inputs: torch.Tensor, training: bool) -> object:
            pipe.train(training)
            try:
                return pipe(inputs)
            finally:
                pipe.train(True)

        return _run_script(case, model, x, y, train, forward, lambda: pipe.clip_grad_norm_(MAX_NORM))
    except ERRORS as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


@one_thread()
def run_zoo_reference(case: Case) -> Observed:
    """A zoo case's script through plain PyTorch: each step on the engine's micro-batches, drawing
    as the engine's stages do (step numbers count every call), the loss weighted as ``train_step``
    weighs it (by rows, or divided by the batch's normalizer), and the front end back-propagated
    once from its output's gradient."""
    model = make_zoo(case)
    convert_dropout(model.layers)
    x, y = make_zoo_batch(case, model)
    x.requires_grad_(case.inputs == "grad_input")
    stages = _stages(case, model.layers)
    step = 0

    def deferred() -> contextlib.AbstractContextManager:
        return _deferred_statistics(model.layers) if case.bn == "deferred" else contextlib.nullcontext()

    def train(inputs: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, object]:
        nonlocal step
        n, m = ys.shape[0], min(case.M, ys.shape[0])
        h = inputs.detach().requires_grad_(True) if model.front is not None else inputs
        # each micro-batch's forward keeps what it saves as it was (CPU BatchNorm saves its running
        # statistics, which the next micro-batch's forward updates in place)
        with deferred(), torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t):
            outs = _forward(stages, h, step, m)
            if case.door == "backward":
                loss = _whole_loss(model, torch.cat(outs), ys)
            else:
                parts = [model.loss_fn(o, t) for o, t in zip(outs, torch.tensor_split(ys, m))]
                loss = (sum(parts) / model.normalizer(ys) if model.normalizer is not None
                        else sum(p * (len(t) / n) for p, t in zip(parts, torch.tensor_split(ys, m))))
        _accumulate(outs, loss)
        if model.front is not None:
            inputs.backward(h.grad)
        step += 1
        return loss, torch.cat([o.detach() for o in outs])

    def forward(inputs: torch.Tensor, training: bool) -> object:
        nonlocal step
        model.layers.train(training)
        with deferred():
            out = torch.cat(_forward(stages, inputs, step, min(case.M, inputs.shape[0])))
        model.layers.train(True)
        step += 1
        return out

    def clip() -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.layers.parameters(), MAX_NORM)

    return _run_script(case, model, x, y, train, forward, clip)


def expected_probe(case: Case) -> list[tuple[bool, bool]]:
    """torchgpipe's rule: (True, False) in a checkpointed forward, (False, True) in its replay."""
    if not case.trains:
        return [(False, False)] * (2 * case.M)
    ck = checkpointed_microbatches(case.checkpoint, case.M)
    return sorted([(i in ck, False) for i in range(case.M)] + [(False, True)] * len(ck))


def expected_error(case: Case) -> str | None:
    """The clear error a combination must raise instead of running (a regex), or None."""
    if case.model == "shared" and {sum(balance_of(case)[:j]) for j in range(1, case.K)} & zoo.tied_cuts(
            make_zoo(case).layers):
        return r"shared parameters cannot cross partitions"
    if case.transition == "short_targets":  # naming the inputs' and the targets' sizes
        return rf"(?is)(?=.*input)(?=.*target)(?=.*\b{case.batch}\b)(?=.*\b{case.batch // 2}\b)"
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

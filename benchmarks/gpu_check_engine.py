"""GPU check sections on the engine: correctness and host syncs (see gpu_check.py).

Each section takes a ``Context`` and returns its figures with ``status``. With
``ctx.dry`` every section runs at tiny sizes on the CPU (wiring only: the
GPU-only criteria are reported as ``"dry"``, never as a GPU figure).
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.bench.workloads import mlp_module
from gpipe_lab.pipeline import CHECKPOINT_MODES, SCHEDULES, GPipe
from gpipe_lab.planner.workload import WorkloadSpec


@dataclass
class Context:
    """Where the check runs: ``cuda:0``, or the CPU for a dry run; ``out``: the reports' folder."""

    device: torch.device
    dry: bool
    out: Path | None = None


#: the file (in ``Context.out``) each section appends its cases to as they start and finish
PROGRESS = "gpu_check_progress.jsonl"


def record_case(ctx: Context, section: str, case: str, **figures: Any) -> None:
    """Append one case's line to the progress file at once (``state="started"`` before it runs,
    its figures after), so a section killed later still says what it finished and where it hung."""
    if ctx.out is not None:
        with open(ctx.out / PROGRESS, "a") as f:
            f.write(json.dumps({"section": section, "case": case, **figures}, default=str) + "\n")


def section_progress(out: Path, section: str) -> dict[str, Any]:
    """What ``section`` wrote to the progress file: cases finished, and the case started but not
    finished (``None``: none)."""
    path = out / PROGRESS
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    open_case, finished = None, 0
    for line in (x for x in lines if x["section"] == section):
        if line.get("state") == "started":
            open_case = line["case"]
        else:
            finished, open_case = finished + 1, None
    return {"cases_finished": finished, "unfinished_case": open_case}


def sync(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _grad_error(module: nn.Sequential, x: Any, y: Tensor, loss_fn: Callable, ctx: Context,
                dtype: torch.dtype | None = None, **options: Any) -> float:
    """Largest |pipelined − unpipelined| gradient, relative to the largest reference gradient
    (the reference on ``ctx.device``; the pipe on ``options["devices"]``, default all there)."""
    devices = options.pop("devices", [ctx.device] * options["partitions"])
    ref, piped = copy.deepcopy(module).to(ctx.device), copy.deepcopy(module)
    autocast = (torch.autocast(ctx.device.type, dtype=dtype) if dtype is not None
                else torch.autocast(ctx.device.type, enabled=False))
    with autocast:
        loss_fn(ref(x), y).backward()
        pipe = GPipe(piped, devices=devices, **options)
        pipe.train_step(x, y, loss_fn)
    return relative_grad_error(ref, piped)


def relative_grad_error(reference: nn.Module, piped: nn.Module) -> float:
    """Largest |piped − reference| gradient over matching parameters, relative to the largest
    reference gradient (at least 1)."""
    scale = max(float(p.grad.abs().max()) for p in reference.parameters() if p.grad is not None)
    errors = [float((a.grad - b.grad.to(a.device)).abs().max())
              for a, b in zip(reference.parameters(), piped.parameters()) if a.grad is not None]
    return max(errors) / max(scale, 1.0)


def _workloads(ctx: Context) -> dict[str, tuple[nn.Sequential, Any, Tensor, Callable]]:
    torch.manual_seed(0)
    mlp = mlp_module(16, 32, 4)
    x = torch.randn(8, 16, device=ctx.device)
    out = {"mlp": (mlp, x, torch.randn(8, 16, device=ctx.device), F.mse_loss)}
    w = WorkloadSpec("tiny", "transformer_tiny", {"dropout": 0.0, "attention_dropout": 0.0,
                                                  "relu_dropout": 0.0}, 8).build()
    tx = tuple(t.to(ctx.device) for t in w.inputs) if isinstance(w.inputs, tuple) else w.inputs.to(ctx.device)
    out["transformer_tiny"] = (w.module, tx, w.targets.to(ctx.device), w.loss_fn)
    return out


class _AllDropouts(nn.Module):
    """Every way a layer draws dropout: nn.Dropout, F.dropout, alpha dropout, attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.drop, self.alpha = nn.Dropout(0.2), nn.AlphaDropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        q = x.view(x.shape[0], 1, 4, -1)
        att = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).reshape_as(x)
        return self.alpha(self.drop(x) + F.dropout(x, 0.3, training=self.training) + att)


def correctness(ctx: Context) -> dict[str, Any]:
    """Gradients equal the unpipelined model's (fp32 1e-5, bf16 2e-2); dropout equal across checkpoint modes."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    failures, worst, runs = [], {"fp32": 0.0, "bf16": 0.0}, 0
    for name, (module, x, y, loss_fn) in _workloads(ctx).items():
        for K, schedule, mode, M in itertools.product((2, 4), SCHEDULES, CHECKPOINT_MODES, (1, 4)):
            # the dry run wires the grid, it does not sweep it: each schedule once, each mode in turn
            turn = CHECKPOINT_MODES[list(SCHEDULES).index(schedule) % len(CHECKPOINT_MODES)]
            if ctx.dry and (K == 4 or M == 1 or (mode != turn if name == "mlp" else schedule != "gpipe")):
                continue
            v = 2 if schedule.startswith("interleaved") else 1
            if K * v > len(module):
                continue
            options = dict(partitions=K, chunks=M, schedule=schedule, checkpoint=mode, virtual_stages=v)
            for label, dtype, tol in (("fp32", None, 1e-5), ("bf16", torch.bfloat16, 2e-2)):
                if label == "bf16" and (mode != "never" or M != 4):
                    continue  # bf16 once per schedule and K
                case = f"{name} K={K} {schedule} {mode} M={M} {label}"
                record_case(ctx, "correctness", case, state="started")
                err = _grad_error(module, x, y, loss_fn, ctx, dtype, **dict(options))
                record_case(ctx, "correctness", case, relative_error=err)
                runs += 1
                worst[label] = max(worst[label], err)
                if err > tol:
                    failures.append(f"{case}: {err:.2e}")
    torch.manual_seed(1)
    body = nn.Sequential(nn.Linear(16, 16), _AllDropouts(), nn.Linear(16, 16), _AllDropouts(), nn.Linear(16, 4))
    x, y = torch.randn(8, 16, device=ctx.device), torch.randn(8, 4, device=ctx.device)
    grads = {}
    for mode in ("always", "never"):
        pipe = GPipe(copy.deepcopy(body), partitions=2, chunks=4, checkpoint=mode, seed=3,
                     devices=[ctx.device] * 2)
        pipe.train_step(x, y, F.mse_loss)
        grads[mode] = [p.grad.clone() for p in pipe.parameters()]
    dropout_equal = all(torch.equal(a, b) for a, b in zip(grads["always"], grads["never"]))
    if not dropout_equal:
        failures.append("dropout differs between checkpoint='always' and 'never'")
    replay = replay_modes(ctx)
    failures += replay.pop("failures")
    return {"status": "FAIL" if failures else "PASS", "runs": runs, "worst_relative_error": worst,
            "dropout_identical_always_never": dropout_equal, "replay_modes": replay, "failures": failures[:20]}


#: how each replay case's stages draw: K=1 alone on a GPU forks its generator; two chunks on one
#: device probe, then guard (only nn.Dropout draws) or dispatch (other draws found)
REPLAY_CASES = {"K=1": (1, _AllDropouts), "K=1 virtual_stages=2 nn.Dropout": (2, lambda: nn.Dropout(0.2)),
                "K=1 virtual_stages=2 all dropouts": (2, _AllDropouts)}
REPLAY_STEPS = 3


def replay_modes(ctx: Context) -> dict[str, Any]:
    """Several steps of each ``REPLAY_CASES`` pipe, checkpoint 'always' against 'never' (gradients
    bitwise equal: the re-materialized forwards drew what the first ones drew), with the replay
    modes each case's forwards took (``StageReplay.first_kind``). On a GPU FORK, GUARD and DISPATCH
    must each have run; the CPU (dry run) has no forking stage, only PROBE, GUARD and DISPATCH."""
    from gpipe_lab.pipeline.stage.replay_policy import DISPATCH, FORK, GUARD, StageReplay

    kinds: dict[str, list[str]] = {}
    failures: list[str] = []
    first_kind = StageReplay.first_kind
    for case, (v, dropout) in REPLAY_CASES.items():
        record_case(ctx, "correctness", f"replay {case}", state="started")
        seen: set[str] = set()

        def recorded(self: StageReplay, training: Any, seen: set[str] = seen) -> str:
            kind = first_kind(self, training)
            seen.add(kind)
            return kind

        torch.manual_seed(1)
        body = nn.Sequential(nn.Linear(16, 16), dropout(), nn.Linear(16, 16), dropout(), nn.Linear(16, 4))
        x, y = torch.randn(8, 16, device=ctx.device), torch.randn(8, 4, device=ctx.device)
        grads = {}
        StageReplay.first_kind = recorded  # type: ignore[method-assign]
        try:
            for mode in ("always", "never"):
                pipe = GPipe(copy.deepcopy(body), partitions=1, chunks=4, virtual_stages=v, checkpoint=mode,
                             seed=3, devices=[ctx.device])
                for _ in range(REPLAY_STEPS):  # the gradients accumulate over the steps
                    pipe.train_step(x, y, F.mse_loss)
                grads[mode] = [p.grad.clone() for p in pipe.parameters()]
        finally:
            StageReplay.first_kind = first_kind  # type: ignore[method-assign]
        kinds[case] = sorted(seen)
        equal = all(torch.equal(a, b) for a, b in zip(grads["always"], grads["never"]))
        record_case(ctx, "correctness", f"replay {case}", kinds=kinds[case], always_equals_never=equal)
        if not equal:
            failures.append(f"replay {case}: dropout differs between checkpoint='always' and 'never'")
    ran = set().union(*map(set, kinds.values()))
    wanted = {GUARD, DISPATCH} | (set() if ctx.device.type == "cpu" else {FORK})
    if not wanted <= ran:
        failures.append(f"replay modes {sorted(wanted - ran)} never ran (ran: {sorted(ran)})")
    return {"steps": REPLAY_STEPS, "kinds": kinds, "failures": failures}


_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _count_reads(step: Callable[[], Any]) -> Counter:
    """Python-level host reads of tensor values (every thread) during ``step``, by call site."""
    seen: Counter = Counter()
    lock = threading.Lock()
    originals = {n: getattr(torch.Tensor, n) for n in _READS}

    def wrap(n: str) -> Callable:
        def read(self: Tensor, *a: Any, **k: Any) -> Any:
            import traceback
            frame = traceback.extract_stack(limit=2)[0]
            with lock:
                seen[f"{n} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
            return originals[n](self, *a, **k)
        return read

    try:
        for n in _READS:
            setattr(torch.Tensor, n, wrap(n))
        step()
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
    return seen


def host_syncs(ctx: Context) -> dict[str, Any]:
    """Host syncs per local step: at most one (the non-finite verdict), with where each comes from."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 4))
    pipe = GPipe(module, partitions=2, chunks=4, deferred_batch_norm=True, nonfinite="skip",
                 devices=[ctx.device] * 2)
    x, y = torch.randn(32, 16, device=ctx.device), torch.randn(32, 4, device=ctx.device)
    pipe.train_step(x, y, F.mse_loss)
    reads = _count_reads(lambda: pipe.train_step(x, y, F.mse_loss))
    result: dict[str, Any] = {"python_reads": dict(reads)}
    if ctx.device.type == "cuda":
        sync(ctx)
        torch.cuda.set_sync_debug_mode("warn")  # outside the recording: switching it on warns itself
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pipe.train_step(x, y, F.mse_loss)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        where = Counter(f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught
                        if "synchroniz" in str(w.message))
        result["cuda_syncs"] = dict(where)
        result["status"] = "PASS" if sum(where.values()) <= 1 else "FAIL"
    else:
        result["status"] = "PASS" if sum(reads.values()) <= 1 else "FAIL"
    return result

"""The differential harness's configurations: axes, the model a case builds, its batch.

A ``Case`` picks one value on every axis. ``recipe()`` is its one-line form, which
``Case.parse`` reads back (``GPIPE_DIFFERENTIAL_CASE=<recipe>`` reruns one case).
The ``model`` axis is the lab's own five-layer model (``lab``, which takes the
option axes) or a zoo architecture (``tests/helpers/zoo.py``), which takes the
``transition``, ``grads`` and ``cost`` axes: a sequence of steps around the door,
the state of ``.grad`` before each training step, and how the cut is chosen.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline import (
    SCHEDULES,
    balance_by_cost,
    is_checkpointing,
    is_recomputing,
    layer_costs,
    schedule_names,
)
from helpers import zoo

WIDTH = 6
SEED = 1234
AXES: dict[str, tuple] = {
    "door": ("train_step", "backward", "nograd_train", "nograd_eval"),
    "K": (1, 2, 3),
    "M": (1, 3, 4),
    "batch": (12, 10),  # 12 divides every M; 10 does not divide 3 or 4
    "checkpoint": ("never", "except_last", "always"),
    # every schedule of the catalog, V-shaped included (one added there is on the axis at once); the
    # V-shaped ones run two stages per rank (``virtual_stages_of``), on the lab model only
    "schedule": (*SCHEDULES, *(name for name in schedule_names() if name not in SCHEDULES)),
    "bn": ("none", "plain", "deferred"),
    "rand": ("none", "dropout", "functional"),
    "autocast": ("none", "bf16"),
    "inputs": ("tensor", "tuple", "tokens", "grad_input"),
    "frozen": (False, True),
    "dtype": ("float32", "float64"),
    "output": ("tensor", "dict"),
    # counting hooks switch off autograd's in-place check of what a forward saved: both ways
    "track_memory": (True, False),
    "transport": ("local", "distributed"),
    "model": ("lab", *zoo.MODELS),
    # what runs around the door (``differential_steps.script``); short_targets must be refused
    "transition": ("none", "eval_train_eval", "nograd_between", "freeze", "batch_change", "short_targets"),
    # each parameter's .grad before a training step: None, zeros, or what the last one left
    # (random before the first)
    "grads": ("none", "zero", "accumulated"),
    # the cut: BALANCE (the lab model), an automatic balance by a layer cost, or every cut before
    # an in-place layer
    "cost": ("fixed", "params", "flops", "activation_bytes", "output_bytes", "time", "inplace"),
}
LAB_BATCH, ZOO_BATCH = (12, 10), (4, 3)
AXES["batch"] = LAB_BATCH + ZOO_BATCH
# the lab model's axes (a zoo model's: ZOO_AXES); the new axes at their first value
LAB_AXES = {**{k: v[:1] for k, v in AXES.items()}, **{k: AXES[k] for k in list(AXES)[:15]}, "batch": LAB_BATCH}
# a zoo model has its own layers and inputs: the lab model's layer axes stay at their first value; its
# ``rand`` says whether it draws (its own dropout; ``zoo.OPTIONAL_DROPOUT`` models take both), ``inputs``
# whether its input needs a gradient (``grad_input``; not for token inputs)
#: the V-shaped schedules: two stages per rank (rank r holds stages r and 2K-1-r); 2K stages of the
#: lab model's five layers, so K <= 2
V_SHAPED = ("zb-v", "dualpipev")
ZOO_AXES = {**AXES, "model": AXES["model"][1:], "batch": ZOO_BATCH, "rand": AXES["rand"][:2],
            "schedule": tuple(name for name in AXES["schedule"] if name not in V_SHAPED),
            "inputs": ("tensor", "grad_input"), **{k: AXES[k][:1] for k in ("autocast", "frozen", "dtype", "output")}}
BALANCE = {1: [5], 2: [2, 3], 3: [2, 1, 2]}  # layer 2 (the probe) sits on stage 0, 1, 1
PROBE_LAYER = 2
V_BALANCE = {1: [2, 3], 2: [1, 1, 1, 2]}


def virtual_stages_of(case: Case) -> int:
    """Stages per rank: 2 for the V-shaped schedules, else 1."""
    return 2 if case.schedule in V_SHAPED else 1


@dataclass(frozen=True)
class Case:
    door: str
    K: int
    M: int
    batch: int
    checkpoint: str
    schedule: str
    bn: str
    rand: str
    autocast: str
    inputs: str
    frozen: bool
    dtype: str
    output: str
    track_memory: bool
    transport: str
    model: str = "lab"
    transition: str = "none"
    grads: str = "none"
    cost: str = "fixed"

    def recipe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in asdict(self).items())

    @classmethod
    def parse(cls, text: str) -> Case:
        """Read ``recipe()``'s form back (a recipe without the zoo's axes is the lab model's).

        Raises:
            ValueError: a key or value outside ``AXES``.
        """
        values = dict(part.split("=", 1) for part in text.split(","))
        typed = {}
        for f in fields(cls):
            if f.name not in values and f.default is not MISSING:
                values[f.name] = str(f.default)
            allowed = {str(v): v for v in AXES[f.name]}
            if values.get(f.name) not in allowed:
                raise ValueError(f"{f.name}={values.get(f.name)!r}; allowed: {sorted(allowed)}")
            typed[f.name] = allowed[values[f.name]]
        return cls(**typed)

    @property
    def trains(self) -> bool:
        return self.door in ("train_step", "backward")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32


def all_cases() -> list[Case]:
    """The full product, less what an axis cannot vary: forward-only doors run fill-drain's
    forward whatever the schedule, so they take the schedule axis at ``gpipe`` only; the
    distributed transport's ``pipe(x)`` has no backward, so its backward door runs ``gpipe``
    only (to see the refusal), and a dict output is tried there with ``train_step`` only
    (the refusal of a non-tensor output is the local transport's test: a rank failing
    mid-forward ends the launch that runs the other cases). The lab model's cases come
    first, then the zoo's (``zoo_domains`` narrows each model's axes before ``valid`` judges)."""
    lab = itertools.starmap(Case, itertools.product(*LAB_AXES.values()))
    return [case for case in itertools.chain(lab, zoo_product()) if valid(case)]


def zoo_product(models: tuple = ZOO_AXES["model"], Ks: tuple = ZOO_AXES["K"]) -> Iterator[Case]:
    """Candidates for the zoo's valid cases of ``models`` and ``Ks`` (``valid`` still judges each)."""
    for model in models:
        for K in Ks:
            narrowed = {**ZOO_AXES, "model": (model,), "K": (K,), **zoo_domains(model, K)}
            yield from itertools.starmap(Case, itertools.product(*narrowed.values()))


@functools.cache
def inplace_layers(model: str) -> tuple[int, ...]:
    """Indices (after the first) of the zoo model's in-place layers, where a stage may start."""
    return tuple(i for i, layer in enumerate(zoo.build(model, SEED).layers) if i and zoo.is_inplace(layer))


@functools.cache
def zoo_domains(model: str, K: int) -> dict[str, tuple]:
    """The ``bn``, ``rand``, ``inputs`` and ``cost`` values a zoo model takes with ``K`` stages:
    BatchNorm plain or deferred where it has one; dropout where it has some; an input gradient
    where the inputs are not indices; one stage needs no cut; ``inplace`` where it has such a layer."""
    bn = ("plain", "deferred") if model in zoo.WITH_BATCH_NORM else ("none",)
    rand = ("none", "dropout") if model in zoo.OPTIONAL_DROPOUT else (
        ("dropout",) if model in zoo.WITH_DROPOUT else ("none",))
    costs = AXES["cost"][1:6] + (("inplace",) if inplace_layers(model) else ())
    inputs = ("tensor",) if model in zoo.TOKEN_INPUTS else ("tensor", "grad_input")
    return {"bn": bn, "rand": rand, "inputs": inputs, "cost": ("params",) if K == 1 else costs}


def valid(case: Case) -> bool:
    """Whether ``all_cases`` holds ``case``."""
    if case.schedule != "gpipe" and (not case.trains or (case.transport == "distributed"
                                                        and case.door == "backward")):
        return False
    if case.transport == "distributed" and case.output == "dict" and case.door != "train_step":
        return False
    if case.schedule in V_SHAPED and (case.model != "lab" or case.K not in V_BALANCE
                                      or (case.schedule == "dualpipev" and case.M < 2 * case.K)):
        return False  # dualpipev needs M >= 2K
    if case.model == "lab":
        return all(getattr(case, k) in v for k, v in LAB_AXES.items())
    domains = {**ZOO_AXES, **zoo_domains(case.model, case.K)}
    if not all(getattr(case, k) in v for k, v in domains.items()):
        return False
    if not steps(case):  # one call of the door, nothing around it (nor a gradient)
        return case.transition == "none" and case.grads == "none" and (case.trains or case.inputs == "tensor")
    # the targets go through the engine only in train_step; their .grad state plays no part in a refusal
    return case.transition != "short_targets" or (case.door == "train_step" and case.grads == "none")


def steps(case: Case) -> bool:
    """Whether the door takes steps: it trains and is not refused (``pipe(x)`` + backward is refused
    across processes and by every schedule but fill-drain)."""
    return case.trains and not (case.door == "backward" and (case.transport == "distributed"
                                                              or case.schedule != "gpipe"))


def random_cases(seed: int, n: int, axes: dict[str, tuple] | None = None, **fixed: object) -> list[Case]:
    """``n`` distinct valid cases drawn with ``seed`` from ``axes`` (``LAB_AXES`` by default, or
    ``ZOO_AXES``), with the axes in ``fixed`` held."""
    rng = random.Random(seed)
    axes = LAB_AXES if axes is None else axes
    out: list[Case] = []
    for _ in range(100_000):  # bounded: held axes no valid case takes must fail, not hang
        case = Case(**{k: fixed[k] if k in fixed else rng.choice(v) for k, v in axes.items()})
        if valid(case) and case not in out:
            out.append(case)
            if len(out) == n:
                return out
    raise ValueError(f"random_cases: {len(out)} of {n} valid cases found with {fixed}")


def pairwise(seed: int, transport: str, tries: int = 100, axes: dict[str, tuple] | None = None) -> list[Case]:
    """Few cases (greedy, seeded) in which every two axes take every pair of values that some
    valid case of ``transport`` takes: each picked case covers the most pairs not yet covered
    among ``tries`` random valid candidates. ``axes``: ``LAB_AXES`` (the default) or ``ZOO_AXES``."""
    rng = random.Random(seed)
    axes = LAB_AXES if axes is None else axes
    names = [n for n in axes if n != "transport" and len(axes[n]) > 1]
    held = {n: v[0] for n, v in axes.items() if n != "transport" and len(v) == 1}

    def draw() -> Case:
        while True:
            values = {n: rng.choice(axes[n]) for n in names}
            model = values.get("model", held.get("model"))
            if model != "lab":  # the model's own domains: fewer draws rejected
                domains = zoo_domains(model, values["K"])
                values.update({n: rng.choice(domains[n]) for n in domains if n in values})
            case = Case(**values, **held, transport=transport)
            if valid(case):
                return case

    def pairs(case: Case) -> set:
        v = [getattr(case, n) for n in names]
        return {(i, v[i], j, v[j]) for i, j in itertools.combinations(range(len(names)), 2)}

    wanted = set().union(*(pairs(draw()) for _ in range(3000)))
    chosen: list[Case] = []
    while wanted:
        best = max((draw() for _ in range(tries)), key=lambda c: len(pairs(c) & wanted))
        if not pairs(best) & wanted:
            break
        chosen.append(best)
        wanted -= pairs(best)
    return chosen


class Probe(nn.Module):
    """Passes its input (a tuple is merged) and records (is_checkpointing, is_recomputing)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x):
        self.seen.append((is_checkpointing(), is_recomputing()))
        return x[0] + x[1] if isinstance(x, tuple) else x


class Noise(nn.Module):
    """Functional draws (no nn.Dropout): F.dropout and randn_like, in training only."""

    def forward(self, x):
        if not self.training:
            return x
        return F.dropout(x, 0.25, True) + 0.05 * torch.randn_like(x)


class OnFirst(nn.Module):
    """Applies ``inner`` to the first element of a pair: the pair crosses a stage boundary."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pair):
        return self.inner(pair[0]), pair[1]


class PairIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, WIDTH)

    def forward(self, pair):
        return self.linear(pair[0]), pair[1]


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return {"y": self.linear(x), "aux": x.sum(dim=1)}


def _block(case: Case) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    if case.bn != "none":
        layers.append(nn.BatchNorm1d(WIDTH))
    layers.append(nn.Tanh())
    if case.rand == "dropout":
        layers.append(nn.Dropout(0.3))
    elif case.rand == "functional":
        layers.append(Noise())
    return nn.Sequential(*layers)


def make_model(case: Case) -> nn.Sequential:
    """Five layers (adapter, block, probe, block, head), the same weights for every call."""
    torch.manual_seed(SEED)
    adapter: nn.Module = {"tuple": PairIn, "tokens": lambda: nn.Embedding(16, WIDTH)}.get(
        case.inputs, lambda: nn.Linear(4, WIDTH))()
    first = _block(case)
    model = nn.Sequential(adapter, OnFirst(first) if case.inputs == "tuple" else first, Probe(), _block(case),
                          DictHead() if case.output == "dict" else nn.Linear(WIDTH, 3))
    if case.frozen:
        adapter.requires_grad_(False)
    return model.to(case.torch_dtype)


def make_batch(case: Case) -> tuple[object, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 1)
    n, dt = case.batch, case.torch_dtype
    y = torch.randn(n, 3, generator=gen, dtype=dt)
    if case.inputs == "tokens":
        return torch.randint(0, 16, (n,), generator=gen), y
    x = torch.randn(n, 4, generator=gen, dtype=dt)
    if case.inputs == "tuple":
        return (x, torch.randn(n, WIDTH, generator=gen, dtype=dt)), y
    if case.inputs == "grad_input":
        x.requires_grad_(True)
    return x, y


def loss_fn(out, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss((out["y"] if isinstance(out, dict) else out).to(y.dtype), y)


def input_tensors(x: object) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)  # type: ignore[return-value]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The caller's intra-op threads at 1 meanwhile: the zoo's convolutions on several threads of a
    loaded machine wait on each other for seconds (the engine's stages run one thread each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_zoo(case: Case) -> zoo.Zoo:
    """The zoo model of ``case``, the same weights for every call."""
    return zoo.build(case.model, SEED, dropout=case.rand != "none")


def make_zoo_batch(case: Case, model: zoo.Zoo) -> tuple[torch.Tensor, torch.Tensor]:
    """The zoo model's batch of ``case.batch`` rows, the same for every call."""
    return model.batch(case.batch, torch.Generator().manual_seed(SEED + 1))


# balances computed in this process (``time`` is measured and varies between runs: a case's engine
# runs and its reference use one cut; the distributed transport's parent sends its cuts to the ranks)
BALANCES: dict[tuple, list[int]] = {}


@one_thread()
def balance_of(case: Case) -> list[int]:
    """The layers per stage of ``case``: ``BALANCE`` for the lab model; for a zoo model the
    automatic balance by ``case.cost`` (measured kinds on the first micro-batch), or for
    ``inplace`` a cut before each of the first K-1 in-place layers (the rest evenly)."""
    if case.model == "lab":
        return V_BALANCE[case.K] if case.schedule in V_SHAPED else BALANCE[case.K]
    key = (case.model, case.K, case.cost, case.batch, case.M)
    if key not in BALANCES:
        model = make_zoo(case)
        n = len(model.layers)
        if case.cost == "inplace":
            cuts = set(inplace_layers(case.model)[:case.K - 1])
            cuts |= set([c for c in range(1, n) if c not in cuts][::max(1, n // case.K)][:case.K - 1 - len(cuts)])
            bounds = [0, *sorted(cuts), n]
            BALANCES[key] = [b - a for a, b in zip(bounds, bounds[1:])]
        else:
            x, _ = make_zoo_batch(case, model)
            sample = torch.tensor_split(x, min(case.M, case.batch))[0]
            if model.front is not None:
                sample = model.front(sample).detach()
            costs = layer_costs(model.layers, case.cost, None if case.cost == "params" else sample)
            BALANCES[key] = balance_by_cost(costs, case.K)
    return list(BALANCES[key])

"""The differential harness's configurations: axes, the model a case builds, its batch.

A ``Case`` picks one value on every axis. ``recipe()`` is its one-line form, which
``Case.parse`` reads back (``GPIPE_DIFFERENTIAL_CASE=<recipe>`` reruns one case).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline import is_checkpointing, is_recomputing

WIDTH = 6
SEED = 1234
AXES: dict[str, tuple] = {
    "door": ("train_step", "backward", "nograd_train", "nograd_eval"),
    "K": (1, 2, 3),
    "M": (1, 3, 4),
    "batch": (12, 10),  # 12 divides every M; 10 does not divide 3 or 4
    "checkpoint": ("never", "except_last", "always"),
    "schedule": ("gpipe", "1f1b", "interleaved-1f1b", "gpipe-bw", "zb-h1", "zb-h2"),
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
}
BALANCE = {1: [5], 2: [2, 3], 3: [2, 1, 2]}  # layer 2 (the probe) sits on stage 0, 1, 1
PROBE_LAYER = 2


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

    def recipe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in asdict(self).items())

    @classmethod
    def parse(cls, text: str) -> Case:
        """Read ``recipe()``'s form back.

        Raises:
            ValueError: a key or value outside ``AXES``.
        """
        values = dict(part.split("=", 1) for part in text.split(","))
        typed = {}
        for f in fields(cls):
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
    mid-forward ends the launch that runs the other cases)."""
    return [case for case in itertools.starmap(Case, itertools.product(*AXES.values())) if valid(case)]


def valid(case: Case) -> bool:
    """Whether ``all_cases`` holds ``case``."""
    if case.schedule != "gpipe" and (not case.trains or (case.transport == "distributed"
                                                        and case.door == "backward")):
        return False
    return not (case.transport == "distributed" and case.output == "dict" and case.door != "train_step")


def random_cases(seed: int, n: int, **fixed: object) -> list[Case]:
    """``n`` distinct valid cases drawn with ``seed``, with the axes in ``fixed`` held."""
    rng = random.Random(seed)
    out: list[Case] = []
    while len(out) < n:
        case = Case(**{k: fixed[k] if k in fixed else rng.choice(v) for k, v in AXES.items()})
        if valid(case) and case not in out:
            out.append(case)
    return out


def pairwise(seed: int, transport: str, tries: int = 100) -> list[Case]:
    """Few cases (greedy, seeded) in which every two axes take every pair of values that some
    valid case of ``transport`` takes: each picked case covers the most pairs not yet covered
    among ``tries`` random valid candidates."""
    rng = random.Random(seed)
    names = [n for n in AXES if n != "transport"]

    def draw() -> Case:
        while True:
            case = Case(*[rng.choice(AXES[n]) for n in names], transport)
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

"""The full product's design: which valid cases ``differential_full.py`` judges, and its proof.

The Cartesian product of the harness's axes (``differential_cases.all_cases``: every
valid case, millions) is replaced by three parts, in this order:

1. ``found``: every combination that found a defect (``differential_found``);
2. ``defects``: the full product over ``DEFECT_AXES``, the axes where those defects
   lived (one valid case for each of their value combinations that a valid case takes);
3. ``covering``: cases added until every ``t`` values of any ``t`` axes that some valid
   case takes (a *feasible t-tuple*) appear together in at least one case of the design:
   a covering array of strength ``t`` (``STRENGTH``) over every axis, constraints honoured
   (only valid cases are ever picked, and only feasible tuples are asked for).

Parts 1 and 2 seed the covering array (their tuples count as covered), so the three
together are the covering array. Each pick is greedy: among valid cases (the ones that
hold the next uncovered tuple, or the next cell of the product) it takes the one that
covers most new tuples per unit of its expected cost (``COST``: a CNN of the zoo costs
twenty times the lab model), seeded, so the design is the same on every machine.
``missing`` is the checker: the feasible tuples a list of cases leaves uncovered.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torchvision
from differential_cases import AXES, Case, all_cases
from differential_found import FOUND, FOUND_45

HERE = Path(__file__).resolve().parent
STRENGTH = 3
# the axes of the FOUND combinations' defects: the zoo's models (and the lab's), what runs around the
# step, .grad at its start, the schedule (with the transport too it costs three times as much: measured)
DEFECT_AXES = ("model", "transition", "grads", "schedule")
SEED = 45
CANDIDATES = 400  # valid cases weighed per pick
# a case's expected seconds relative to the lab model's (measured per model on this VM, loaded): only
# which case a pick prefers depends on it, never what is covered
COST = {"lab": 1.0, "shared": 0.5, "front": 1.0, "sparse": 1.0, "tagger": 5.0, "vit": 4.0, "resnet": 20.0,
        "mobilenet": 20.0, "squeezenet": 24.0}
DISTRIBUTED_COST = 3.0  # a case of the distributed transport, against the same case on the local one
SOURCES = ("differential_cases.py", "differential_found.py", "differential_design.py", "../helpers/zoo.py")
NAMES = tuple(AXES)


def encode(cases: Sequence[Case]) -> np.ndarray:
    """Cases as rows of value indices, one column per axis of ``AXES`` (in its order)."""
    columns = []
    for name in NAMES:
        index = {v: i for i, v in enumerate(AXES[name])}
        get = operator.attrgetter(name)
        columns.append(np.fromiter((index[get(c)] for c in cases), np.int8, len(cases)))
    return np.stack(columns, 1) if columns else np.zeros((0, len(NAMES)), np.int8)


def decode(row: Sequence[int]) -> Case:
    return Case(**{name: AXES[name][int(i)] for name, i in zip(NAMES, row)})


class Tuples:
    """Every t-tuple of (axis, value) pairs of axes of ``sizes``, numbered 0..count-1: the
    combination of axes in ``itertools.combinations`` order, then the values in mixed radix."""

    def __init__(self, sizes: Sequence[int], strength: int) -> None:
        self.sizes, self.strength = list(sizes), strength
        self.combos = np.array(list(itertools.combinations(range(len(sizes)), strength)), np.int64)
        self.mult = np.array([[math.prod(self.sizes[a] for a in c[k + 1:]) for k in range(strength)]
                              for c in self.combos.tolist()], np.int64)
        spans = [math.prod(self.sizes[a] for a in c) for c in self.combos.tolist()]
        self.offset = np.concatenate([[0], np.cumsum(spans)[:-1]]).astype(np.int64)
        self.count = int(sum(spans))

    def ids(self, rows: np.ndarray) -> np.ndarray:
        """The tuples each row holds: (rows, combinations) numbers."""
        rows = np.asarray(rows, np.int64).reshape(-1, len(self.sizes))
        return (rows[:, self.combos] * self.mult).sum(-1) + self.offset

    def feasible(self, rows: np.ndarray) -> np.ndarray:
        """A flag per tuple: some row holds it (``rows``: every valid case)."""
        out = np.zeros(self.count, bool)
        rows = np.asarray(rows).astype(np.int32)
        spans = {tuple(c): math.prod(self.sizes[a] for a in c) for c in self.combos.tolist()}
        offsets = dict(zip(spans, self.offset.tolist()))

        def flag(combo: tuple[int, ...], code: np.ndarray) -> None:
            if len(combo) == self.strength:
                out[offsets[combo]:offsets[combo] + spans[combo]] = np.bincount(code, minlength=spans[combo]) > 0
                return
            for a in range(combo[-1] + 1, len(self.sizes)):  # the code of a longer prefix, one pass each
                flag((*combo, a), code * self.sizes[a] + rows[:, a])

        for a in range(len(self.sizes)):
            flag((a,), rows[:, a])
        return out

    def describe(self, number: int, names: Sequence[str], values: Sequence[Sequence]) -> str:
        """One tuple as ``axis=value, ...``."""
        c = int(np.searchsorted(self.offset, number, side="right") - 1)
        rest, parts = number - int(self.offset[c]), []
        for a, m in zip(self.combos[c].tolist(), self.mult[c].tolist()):
            parts.append(f"{names[a]}={values[a][rest // m]}")
            rest %= m
        return ", ".join(parts)

    def locate(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """One tuple's axes and value indices."""
        c = int(np.searchsorted(self.offset, number, side="right") - 1)
        return self.combos[c], (number - self.offset[c]) // self.mult[c] % np.array(
            [self.sizes[a] for a in self.combos[c]])


def missing(design: np.ndarray, feasible: np.ndarray, tuples: Tuples) -> np.ndarray:
    """The checker: the numbers of the feasible tuples no row of ``design`` holds."""
    covered = np.zeros(tuples.count, bool)
    if len(design):
        covered[tuples.ids(design).ravel()] = True
    return np.flatnonzero(feasible & ~covered)


def cover(valid: np.ndarray, cost: np.ndarray, tuples: Tuples, feasible: np.ndarray, seeds: np.ndarray,
          rng: np.random.Generator, product: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Greedy picks from the rows ``valid`` (their ``cost``; ``feasible``: the tuples they hold):
    first one row for each value combination of the axes ``product`` that a valid row takes
    (skipped where a seed holds it), then rows until every feasible tuple is covered. ``seeds``
    count as picked. Returns the rows picked for the product and those picked for the covering.
    """
    uncovered = feasible.copy()
    if len(seeds):
        uncovered[tuples.ids(seeds).ravel()] = False

    def pick(candidates: np.ndarray) -> np.ndarray:
        if len(candidates) > CANDIDATES:
            candidates = candidates[rng.integers(0, len(candidates), CANDIDATES)]
        gains = uncovered[tuples.ids(valid[candidates])].sum(1)
        best = valid[candidates[int(np.argmax(gains / cost[candidates]))]]
        uncovered[tuples.ids(best).ravel()] = False
        return best

    in_product: list[np.ndarray] = []
    if len(product):
        radix = np.array([math.prod(tuples.sizes[a] for a in product[k + 1:]) for k in range(len(product))])
        cells = valid[:, list(product)].astype(np.int64) @ radix
        order = np.argsort(cells, kind="stable")
        bounds = np.flatnonzero(np.diff(cells[order])) + 1
        seeded = set((seeds[:, list(product)].astype(np.int64) @ radix).tolist()) if len(seeds) else set()
        for group in np.split(order, bounds):
            if int(cells[group[0]]) not in seeded:
                in_product.append(pick(group))
    covering: list[np.ndarray] = []
    while (left := np.flatnonzero(uncovered)).size:
        axes, values = tuples.locate(int(left[0]))
        covering.append(pick(np.flatnonzero((valid[:, axes] == values).all(1))))
    width = valid.shape[1]
    return np.array(in_product, np.int8).reshape(-1, width), np.array(covering, np.int8).reshape(-1, width)


def case_costs(rows: np.ndarray) -> np.ndarray:
    """``COST`` of each row (its model; times ``DISTRIBUTED_COST`` across processes)."""
    model = np.array([COST[m] for m in AXES["model"]])
    transport = np.array([DISTRIBUTED_COST if t == "distributed" else 1.0 for t in AXES["transport"]])
    return model[rows[:, NAMES.index("model")]] * transport[rows[:, NAMES.index("transport")]]


def design_key() -> str:
    """What the design depends on: the axes (the schedule catalog's names included), the sources
    that judge validity and pick cases, torchvision's version (the zoo's layers)."""
    h = hashlib.sha256(repr(AXES).encode() + torchvision.__version__.encode()
                       + repr((STRENGTH, DEFECT_AXES, SEED, CANDIDATES, COST, DISTRIBUTED_COST)).encode())
    for name in SOURCES:
        h.update((HERE / name).read_bytes())
    return h.hexdigest()[:12]


@dataclass
class Design:
    """The three parts (rows of value indices), the size of what they stand for, and the covering proof."""

    key: str
    found: list[list[int]]
    defects: list[list[int]]
    covering: list[list[int]]
    valid: int  # the valid cases of the Cartesian product
    cartesian: int  # the Cartesian product of every axis, invalid combinations included
    feasible: int  # the feasible tuples, each covered
    strength: int = STRENGTH
    defect_axes: tuple[str, ...] = DEFECT_AXES

    def cases(self) -> list[Case]:
        """Every case, in the order the shard logs number them."""
        return [decode(r) for r in self.found + self.defects + self.covering]

    def save(self, path: Path) -> None:
        """As JSON: the sizes, the axes' values, then each part one case (value indices) a line."""
        data = {**self.__dict__, "defect_axes": list(self.defect_axes),
                "axes": {k: [str(v) for v in vs] for k, vs in AXES.items()}}
        lines = [f' "{k}": {json.dumps(v)}' for k, v in data.items() if k not in ("found", "defects", "covering")]
        lines += [f' "{k}": [\n' + ",\n".join(f"  {json.dumps(r)}" for r in data[k]) + "\n ]"
                  for k in ("found", "defects", "covering")]
        path.write_text("{\n" + ",\n".join(lines) + "\n}\n")

    @classmethod
    def load(cls, path: Path) -> Design | None:
        """The design saved at ``path`` if it is the current one (``design_key``), else None."""
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        if data.get("key") != design_key():
            return None
        data.pop("axes")
        return cls(**{**data, "defect_axes": tuple(data["defect_axes"])})


def make_design(cases: Sequence[Case] | None = None) -> Design:
    """The design over ``cases`` (every valid case: ``all_cases()`` by default, about a minute).

    Raises:
        RuntimeError: a FOUND combination is not valid, or the design misses a feasible tuple
            (the checker's verdict, naming one).
    """
    cases = all_cases() if cases is None else cases
    valid = encode(cases)
    tuples = Tuples([len(v) for v in AXES.values()], STRENGTH)
    found_cases = list(dict.fromkeys(Case.parse(r) for r in FOUND + FOUND_45))
    if not set(found_cases) <= set(cases):
        raise RuntimeError(f"a FOUND combination is not a valid case: {set(found_cases) - set(cases)}")
    found = encode(found_cases)
    product = [NAMES.index(a) for a in DEFECT_AXES]
    feasible = tuples.feasible(valid)
    defects, covering = cover(valid, case_costs(valid), tuples, feasible, found, np.random.default_rng(SEED),
                              product)
    gaps = missing(np.concatenate([found, defects, covering]), feasible, tuples)
    if gaps.size:
        raise RuntimeError(f"the design misses {gaps.size} feasible tuples, e.g. "
                           f"{tuples.describe(int(gaps[0]), NAMES, list(AXES.values()))}")
    return Design(design_key(), found.tolist(), defects.tolist(), covering.tolist(), len(cases),
                  math.prod(len(v) for v in AXES.values()), int(feasible.sum()))


__all__ = ["DEFECT_AXES", "Design", "STRENGTH", "Tuples", "cover", "decode", "encode", "make_design", "missing"]

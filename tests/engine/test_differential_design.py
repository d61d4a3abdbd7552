"""The full product's design (``differential_design``): the covering array's checker and generator."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from differential_cases import AXES, LAB_AXES, ZOO_AXES, Case, random_cases, valid
from differential_design import DEFECT_AXES, NAMES, Design, Tuples, cover, encode, make_design, missing
from differential_found import FOUND, FOUND_45

from gpipe_lab.pipeline import schedule_names

SIZES = (3, 2, 4, 2, 3)


def toy_valid() -> np.ndarray:
    """The product of ``SIZES`` less a constraint (axis 0 at 2 takes axis 2 at 0 only)."""
    rows = [r for r in itertools.product(*map(range, SIZES)) if not (r[0] == 2 and r[2] != 0)]
    return np.array(rows, np.int8)


def test_the_checker_names_each_triple_a_design_leaves_out() -> None:
    tuples = Tuples(SIZES, 3)
    rows = toy_valid()
    feasible = tuples.feasible(rows)
    assert not missing(rows, feasible, tuples).size  # every valid case: every feasible triple
    # axis 0 at 2 never meets axis 2 at 1: not feasible, so not asked for
    held = tuples.ids(np.array([[2, 0, 1, 0, 0]]))[0]
    with_both = [0 in c and 2 in c for c in tuples.combos.tolist()]
    assert not feasible[held[with_both]].any() and feasible[held[np.logical_not(with_both)]].all()
    gone = rows[~((rows[:, 2] == 3) & (rows[:, 3] == 1) & (rows[:, 4] == 2))]  # every case holding one triple
    gaps = missing(gone, feasible, tuples)
    assert [tuples.describe(int(g), "abcde", [range(s) for s in SIZES]) for g in gaps] == ["c=3, d=1, e=2"]
    axes, values = tuples.locate(int(gaps[0]))
    assert axes.tolist() == [2, 3, 4] and values.tolist() == [3, 1, 2]


@pytest.mark.parametrize("strength", [2, 3])
def test_the_greedy_covering_array_covers_every_feasible_tuple_and_each_pick_counts(strength: int) -> None:
    tuples, rows = Tuples(SIZES, strength), toy_valid()
    feasible = tuples.feasible(rows)
    seeds = rows[:1]
    product, picked = cover(rows, np.ones(len(rows)), tuples, feasible, seeds, np.random.default_rng(0), [0, 2])
    # one case per value combination of the product's axes that a valid case takes, less the seed's
    assert len(product) == len({(r[0], r[2]) for r in rows.tolist()}) - 1
    design = np.concatenate([seeds, product, picked])
    assert not missing(design, feasible, tuples).size
    assert len(picked) < len(rows) // 3  # far fewer than the product
    assert {tuple(r) for r in design.tolist()} <= {tuple(r) for r in rows.tolist()}  # valid cases only
    for drop in (len(design) - 1, len(seeds) + len(product)):  # the covering's last and first pick
        assert missing(np.delete(design, drop, 0), feasible, tuples).size, f"case {drop} covers nothing new"


def test_a_design_over_real_cases_holds_found_the_defect_product_and_covers(tmp_path: Path) -> None:
    found = [Case.parse(r) for r in FOUND + FOUND_45]
    drawn = random_cases(1, 150) + random_cases(2, 250, axes=ZOO_AXES)
    cases = list(dict.fromkeys(found + drawn))
    design = make_design(cases)  # raises if the checker finds a gap
    got = design.cases()
    assert got[:len(set(found))] == list(dict.fromkeys(found)) and set(got) <= set(cases)
    assert len(got) == len(set(got)) < len(cases)
    cells = {tuple(getattr(c, a) for a in DEFECT_AXES) for c in cases}
    assert {tuple(getattr(c, a) for a in DEFECT_AXES) for c in got} == cells
    tuples = Tuples([len(v) for v in AXES.values()], design.strength)
    feasible = tuples.feasible(encode(cases))
    assert design.feasible == int(feasible.sum())
    assert not missing(encode(got), feasible, tuples).size
    assert missing(encode(got[:-1]), feasible, tuples).size  # the last pick is needed
    design.save(tmp_path / "design.json")
    assert Design.load(tmp_path / "design.json") == design == make_design(cases)  # the same every time


def test_every_catalog_schedule_is_on_the_schedule_axis_and_every_case_is_valid() -> None:
    assert AXES["schedule"] == LAB_AXES["schedule"] and set(AXES["schedule"]) == set(schedule_names())
    assert list(AXES) == list(NAMES)
    assert all(valid(Case.parse(r)) for r in FOUND + FOUND_45)

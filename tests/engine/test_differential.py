"""The differential harness: every combination of the engine's axes against plain PyTorch.

Axes and the model: ``differential_cases``; the two runs and what is compared:
``differential_run``. CI runs a fixed-seed pairwise sample of the lab model's axes and one of
the zoo's (``tests/helpers/zoo.py``), and the combinations that found defects; ``GPIPE_DIFFERENTIAL=full``
runs the whole product (or ``=N``, a sample of N); ``GPIPE_DIFFERENTIAL_CASE=<recipe>`` runs one case (the line a
failing case prints). Each case also runs twice and must be bitwise equal.
"""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch
import torch.nn.functional as F
from differential_cases import (
    SEED,
    ZOO_AXES,
    Case,
    DictHead,
    all_cases,
    loss_fn,
    make_zoo_batch,
    pairwise,
    random_cases,
    valid,
    zoo_product,
)
from differential_distributed import run_distributed
from differential_found import FOUND, FOUND_45
from differential_run import MAX_NORM, Observed, judge, run_engine, run_reference, whole_model
from torch import nn

from gpipe_lab.pipeline import GPipe
from helpers import zoo

SAMPLE_DISTRIBUTED = 4


def check(case: Case) -> None:
    """Run ``case`` through the engine (twice) and plain PyTorch; fail with its recipe."""
    rerun = f"GPIPE_DIFFERENTIAL_CASE='{case.recipe()}' python -m pytest tests/engine/test_differential.py"
    got, again = _distributed()[case] if case.transport == "distributed" else (run_engine(case), None)
    problems = judge(case, got, again)
    assert not problems, rerun + "\n" + "\n".join(problems)


def _params(cases: list[Case]) -> list:
    out = []
    for case in cases:
        # one worker holds the module's one launch (``_distributed``)
        marks = [pytest.mark.xdist_group("differential_distributed")] if case.transport == "distributed" else []
        out.append(pytest.param(case, id=case.recipe(), marks=marks))
    return out


def _selected() -> list[Case]:
    """The cases of this run: one (``GPIPE_DIFFERENTIAL_CASE``), all (``GPIPE_DIFFERENTIAL=full``),
    a fixed-seed sample of N (``GPIPE_DIFFERENTIAL=N``), or CI's: local cases in which every two
    axes take every pair of their values (``pairwise``: the lab model's axes, then the zoo's), and a
    few distributed ones of each in one launch (K=2). ``GPIPE_DIFFERENTIAL_SHARD=i/n`` keeps every n-th
    case from the i-th (0-based), to spread the full product over n jobs."""
    if os.environ.get("GPIPE_DIFFERENTIAL_CASE"):
        return [Case.parse(os.environ["GPIPE_DIFFERENTIAL_CASE"])]
    mode = os.environ.get("GPIPE_DIFFERENTIAL", "")
    if mode == "full" or mode.isdigit():
        cases = all_cases()
        chosen = cases if mode == "full" else random.Random(27).sample(cases, min(int(mode), len(cases)))
        shard = os.environ.get("GPIPE_DIFFERENTIAL_SHARD", "0/1")
        i, n = (int(v) for v in shard.split("/"))
        return chosen[i::n]
    zoo_distributed = random_cases(45, SAMPLE_DISTRIBUTED, axes=ZOO_AXES, transport="distributed", K=2)
    v_shaped = random_cases(50, 1, transport="distributed", K=2, schedule="dualpipev")  # two stages per rank
    return (pairwise(27, "local") + random_cases(27, SAMPLE_DISTRIBUTED, transport="distributed", K=2)
            + v_shaped + pairwise(45, "local", axes=ZOO_AXES) + zoo_distributed)


SELECTED = _selected()


@functools.cache
def _distributed() -> dict[Case, tuple[Observed, Observed]]:
    """The selected distributed cases' two runs, and FOUND's, launched once for the module."""
    found = map(Case.parse, FOUND + FOUND_45)
    cases = dict.fromkeys(c for c in [*SELECTED, *found] if c.transport == "distributed")
    return run_distributed(list(cases))


@pytest.mark.parametrize("case", _params([Case.parse(r) for r in FOUND]))
def test_the_combinations_that_found_issue_27s_defects(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("case", _params([Case.parse(r) for r in FOUND_45]))
def test_the_combinations_that_found_issue_45s_defects(case: Case) -> None:
    check(case)


def test_every_found_combination_is_in_the_full_product() -> None:
    assert all(valid(Case.parse(r)) for r in FOUND + FOUND_45)


@pytest.mark.parametrize("case", _params(SELECTED))
def test_combination_matches_plain_pytorch(case: Case) -> None:
    check(case)


def test_an_empty_sequential_is_refused_naming_the_identity_workaround() -> None:
    # torchgpipe runs GPipe(nn.Sequential(), []) as the identity; here a pipeline has at least one stage
    for build in (lambda: GPipe(nn.Sequential(), []), lambda: GPipe(nn.Sequential(), partitions=1)):
        with pytest.raises(ValueError, match=r"no layers.*nn\.Identity\(\)"):
            build()
    pipe = GPipe(nn.Sequential(nn.Identity()), balance=[1], chunks=2)  # the workaround it names
    x = torch.randn(4, 3)
    assert torch.equal(pipe(x), x)


def test_a_dict_output_is_joined_only_where_the_caller_asks_for_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), DictHead())
    pipe = GPipe(model, balance=[2, 1], chunks=2)
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    loss = pipe.train_step(x, y, loss_fn)  # loss_fn reads the dict
    assert torch.allclose(loss, F.mse_loss(model(x)["y"], y), atol=1e-6)
    with pytest.raises(TypeError, match=r"last partition's output \(micro-batch 0\) is a dict; .*return_outputs"):
        pipe.train_step(x, y, loss_fn, return_outputs=True)


@pytest.mark.parametrize("model", ["resnet", "vit", "tagger", "sparse", "front", "shared"])
def test_the_zoo_reference_is_one_plain_pytorch_step_with_one_micro_batch(model: str) -> None:
    # the harness's reference (micro-batches, stage generators, the script) reduces to plain PyTorch
    case = Case.parse(f"door=train_step,K=1,M=1,batch=4,checkpoint=never,schedule=gpipe,"
                      f"bn={'plain' if model in zoo.WITH_BATCH_NORM else 'none'},rand=none,autocast=none,"
                      f"inputs=tensor,frozen=False,dtype=float32,output=tensor,track_memory=True,transport=local,"
                      f"model={model},transition=none,grads=none,cost=params")
    want = run_reference(case)
    plain = zoo.build(model, SEED, dropout=False)
    x, y = make_zoo_batch(case, plain)
    loss = zoo.plain_step(plain, x, y)
    norm = torch.nn.utils.clip_grad_norm_(plain.layers.parameters(), MAX_NORM)
    torch.testing.assert_close(want["loss"], loss.reshape(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(want["norm"], norm, rtol=1e-6, atol=1e-6)
    params = dict(whole_model(plain).named_parameters())
    assert set(want["grads"]) == set(params)
    for name, p in params.items():
        torch.testing.assert_close(want["grads"][name], p.grad.to_dense(), rtol=1e-6, atol=1e-6)


def test_a_zoo_gradient_off_by_more_than_the_tolerance_fails_loudly() -> None:
    case = Case.parse("door=train_step,K=1,M=3,batch=4,checkpoint=except_last,schedule=gpipe,bn=none,rand=none,"
                      "autocast=none,inputs=grad_input,frozen=False,dtype=float32,output=tensor,track_memory=True,"
                      "transport=local,model=shared,transition=freeze,grads=accumulated,cost=params")
    got = run_engine(case)
    assert judge(case, got, got) == []
    got["grads"]["layers.0.weight"][0, 0] += 2e-5
    got["input_grad"][0][0, 0] += 2e-5
    problems = judge(case, got, got)
    assert [p.split(":")[0] for p in problems] == ["grads[layers.0.weight]", "input_grad[0]"]


@pytest.mark.parametrize("model", ["front", "vit"])
def test_the_zoo_product_holds_every_valid_case_the_axes_allow(model: str) -> None:
    # the product narrows each model's axes before judging (speed); a valid draw must be in it
    product = {c for c in zoo_product((model,), (1,)) if valid(c)}
    drawn = random_cases(3, 40, axes=ZOO_AXES, model=model, K=1)
    assert drawn and set(drawn) <= product

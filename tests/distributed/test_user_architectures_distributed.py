"""Users' architectures on DistributedGPipe over gloo (issue 45): each against the unpipelined model.

One bounded launch of 2 ranks runs every case (a launch costs seconds of imports) and
returns, per case, the loss and this rank's gradients under the unpipelined module's
names; each test compares its part with a single-process reference to 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local
from helpers.user_models import (
    ScaleInPlace,
    TorchAttention,
    attention_model,
    inplace_model,
    sparse_model,
    vit,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240),
              pytest.mark.xdist_group("test_user_architectures_distributed")]

INPLACE = [(s, c) for s in ("gpipe", "1f1b", "gpipe-bw", "zb-h1") for c in ("never", "always", "except_last")]
VIT = [("gpipe-bw", [3, 3], 4, 4), ("gpipe-bw", [3, 3], 3, 8), ("zb-h1", [2, 4], 4, 4), ("zb-h2", [2, 4], 4, 4)]


def named_grads(pipe: DistributedGPipe) -> dict[str, Tensor | None]:
    """This rank's gradients (dense), under the unpipelined module's parameter names."""
    grads: dict[str, Tensor | None] = {}
    for first, part in pipe._chunks.values():
        for name, p in part.named_parameters():
            i, _, rest = name.partition(".")
            grads[f"{int(i) + first}.{rest}"] = None if p.grad is None else p.grad.to_dense().clone()
    return grads


def vit_batch(rows: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 4, 6, generator=g), torch.randn(rows, 3, generator=g)


def small_batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def vit_case(schedule: str, balance: list[int], rows: int, chunks: int) -> tuple:
    pipe = DistributedGPipe(vit(), balance=balance, chunks=chunks, schedule=schedule)  # .grad None at the start
    return pipe.train_step(*vit_batch(rows), F.mse_loss).item(), named_grads(pipe)


def inplace_case(schedule: str, checkpoint: str) -> tuple:
    pipe = DistributedGPipe(inplace_model(ScaleInPlace()), balance=[2, 3], chunks=3, schedule=schedule,
                            checkpoint=checkpoint)
    return pipe.train_step(*small_batch(), F.mse_loss).item(), named_grads(pipe)


def front_case() -> tuple:
    """A trainable front end outside the pipe, on every rank; rank 0 feeds stage 0 from its graph."""
    torch.manual_seed(0)
    front = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = DistributedGPipe(body, balance=[2, 2], chunks=3, schedule="zb-h1")
    x, y = small_batch()
    loss = pipe.train_step(front(x), y, F.mse_loss).item()
    return loss, named_grads(pipe), [None if p.grad is None else p.grad.clone() for p in front.parameters()]


def sparse_case() -> tuple:
    """A sparse embedding first: the default non-finite check, and clipping over the pipeline."""
    pipe = DistributedGPipe(sparse_model(), balance=[2, 3], chunks=3)
    ids = torch.randint(0, 10, (6, 3), generator=torch.Generator().manual_seed(4))
    loss = pipe.train_step(ids, small_batch()[1], F.mse_loss).item()
    norm = pipe.clip_grad_norm_(0.1).item()
    return loss, named_grads(pipe), norm  # the gradients as clipped


def modes_case() -> tuple:
    """An evaluation pass before training: the same draws as a pipe that trains at once."""
    x, y = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(5)), torch.randn(4, 5, 2)
    fresh = DistributedGPipe(attention_model(TorchAttention), balance=[2, 3], chunks=2, checkpoint="always")
    expected = fresh.train_step(x, y, F.mse_loss, step=1).item()
    pipe = DistributedGPipe(attention_model(TorchAttention), balance=[2, 3], chunks=2, checkpoint="always")
    pipe.eval()
    with torch.no_grad():
        pipe(x)
    pipe.train()
    return expected, pipe.train_step(x, y, F.mse_loss, step=1).item(), named_grads(fresh), named_grads(pipe)


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    tied, again = nn.Linear(4, 4), nn.Linear(4, 4)
    again.weight = tied.weight
    return nn.Sequential(nn.Linear(4, 4), tied, nn.Tanh(), again, nn.Linear(4, 2))


def shared_case() -> str | None:
    """A cut between two layers of one parameter: refused at construction, as GPipe refuses it."""
    try:
        DistributedGPipe(tied_model(), balance=[2, 3], chunks=2)
    except ValueError as exc:
        return str(exc)
    return None


def targets_case() -> str | None:
    """Targets of another batch size: refused on every rank (run last: a refusal signals the peers)."""
    pipe = DistributedGPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], chunks=4)
    try:
        pipe.train_step(torch.randn(8, 4), torch.randn(4, 2), F.mse_loss)
    except ValueError as exc:
        return str(exc)
    return None


def attempt(case: Any, *args: Any) -> Any:
    """The case's result, or the error it raised (so each test reports its own case)."""
    try:
        return case(*args)
    except Exception as exc:  # noqa: BLE001 - reported by the case's test
        return f"raised {type(exc).__name__}: {exc}"


def worker(rank: int, world: int) -> dict[str, Any]:
    return {"vit": [attempt(vit_case, *case) for case in VIT],
            "inplace": [attempt(inplace_case, *case) for case in INPLACE],
            "front": attempt(front_case), "sparse": attempt(sparse_case), "modes": attempt(modes_case),
            "shared": attempt(shared_case), "targets": attempt(targets_case)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    ranks = run_local(worker, 2, timeout=200)
    for r in ranks:
        assert r.exitcode == 0, r.error
    return [r.value for r in ranks]


def merged(results: list[dict[str, Any]], key: str, index: int | None = None) -> tuple[list[float], dict]:
    """Each rank's loss, and the gradients of both ranks together."""
    losses, grads = [], {}
    for value in results:
        case = value[key] if index is None else value[key][index]
        assert not isinstance(case, str), case
        losses.append(case[0])
        grads.update(case[1])
    return losses, grads


def assert_equal(model: nn.Module, loss: Tensor, losses: list[float], grads: dict) -> None:
    assert losses == pytest.approx([loss.item()] * len(losses), abs=1e-5)
    expected = dict(model.named_parameters())
    assert sorted(grads) == sorted(expected)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name].grad.to_dense(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("case", range(len(VIT)), ids=[f"{s}-{b}-B{r}-M{m}" for s, b, r, m in VIT])
def test_vit_with_grad_none_equals_unpipelined(results: list, case: int) -> None:
    model = vit()
    x, y = vit_batch(VIT[case][2])
    loss = F.mse_loss(model(x), y)
    loss.backward()
    assert_equal(model, loss, *merged(results, "vit", case))


@pytest.mark.parametrize("case", range(len(INPLACE)), ids=[f"{s}-{c}" for s, c in INPLACE])
def test_an_in_place_first_layer_of_a_stage_equals_unpipelined(results: list, case: int) -> None:
    model = inplace_model(ScaleInPlace())
    x, y = small_batch()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    assert_equal(model, loss, *merged(results, "inplace", case))


def test_a_front_end_outside_the_pipe_gets_plain_gradients(results: list) -> None:
    torch.manual_seed(0)
    front = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    x, y = small_batch()
    loss = F.mse_loss(body(front(x)), y)
    loss.backward()
    assert_equal(body, loss, *merged(results, "front"))
    for got, p in zip(results[0]["front"][2], front.parameters()):  # rank 0 holds stage 0
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-5)
    assert all(g is None for g in results[1]["front"][2])  # rank 1's front end fed nothing


def test_sparse_gradients_and_clipping_equal_torch(results: list) -> None:
    model = sparse_model()
    ids = torch.randint(0, 10, (6, 3), generator=torch.Generator().manual_seed(4))
    loss = F.mse_loss(model(ids), small_batch()[1])
    loss.backward()
    reference = copy.deepcopy(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert [v["sparse"][2] for v in results] == pytest.approx([norm.item()] * 2, abs=1e-5)
    losses, grads = merged(results, "sparse")
    for name, p in reference.named_parameters():  # clipped alike: the clipped reference's gradients
        p.grad = dict(model.named_parameters())[name].grad
    assert_equal(reference, loss, losses, grads)


def test_an_evaluation_pass_before_training_draws_what_training_at_once_draws(results: list) -> None:
    for value in results:
        assert not isinstance(value["modes"], str), value["modes"]
        expected, got, fresh, piped = value["modes"]
        assert got == pytest.approx(expected, abs=1e-6)
        for name, g in fresh.items():
            torch.testing.assert_close(piped[name], g, atol=1e-6, rtol=1e-6, msg=name)


def test_targets_of_another_batch_size_are_refused_on_every_rank(results: list) -> None:
    for value in results:
        assert value["targets"] is not None and "targets have batch size 4 but inputs have 8" in value["targets"]


def test_a_cut_through_a_shared_parameter_is_refused_on_every_rank_as_gpipe_refuses_it(results: list) -> None:
    with pytest.raises(ValueError, match="shared parameters cannot cross partitions") as local:
        GPipe(tied_model(), balance=[2, 3], chunks=2)
    assert [value["shared"] for value in results] == [str(local.value)] * 2

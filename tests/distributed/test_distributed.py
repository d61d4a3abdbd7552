"""DistributedGPipe on spawned gloo processes: equal to the unpipelined module.

One bounded launch (``run_local``) per world size, shared by the tests of the module
(a launch costs seconds of imports): its workers loop over many configurations and
return, per test, losses, gradients under the original parameter names, memory counts
and timelines; each test compares its part with a single-process reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline import PipelineOptions
from gpipe_lab.pipeline.distributed import DistributedGPipe, seeded_init
from gpipe_lab.pipeline.distributed.spawn import run_local

# one worker runs the module: test_grid_equals_unpipelined reaches the launches by name
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240), pytest.mark.xdist_group("test_distributed")]


def mlp(width: int = 8, blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                           for _ in range(blocks)])


def batch(n: int, width: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def local_grads(pipe: DistributedGPipe) -> dict[str, torch.Tensor]:
    grads = {}
    for first, part in pipe._chunks.values():
        for name, p in part.named_parameters():
            i, _, rest = name.partition(".")
            grads[f"{int(i) + first}.{rest}"] = p.grad.clone()
    return grads


def reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check(results: list, expected_loss: float, expected_grads: dict, key: int) -> None:
    for r in results:
        assert r.exitcode == 0, r.error
    grads: dict = {}
    for r in results:
        loss, g = r.value[key][0], r.value[key][1]
        assert loss == pytest.approx(expected_loss, abs=1e-5)
        grads.update(g)
    assert sorted(grads) == sorted(expected_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected_grads[name], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the shared launches
def world2_worker(rank: int, world: int) -> dict:
    return {"grid": grid_worker(rank, world), "split": split_worker(rank, world), "misc": misc_worker(rank, world)}


def world4_worker(rank: int, world: int) -> dict:
    return {"grid": grid_worker(rank, world), "dp": dp_worker(rank, world)}


@pytest.fixture(scope="module")
def world2() -> list:
    return run_local(world2_worker, 2, timeout=200)


@pytest.fixture(scope="module")
def world4() -> list:
    return run_local(world4_worker, 4, timeout=200)


def part(results: list, key: str) -> list[SimpleNamespace]:
    """Each rank's result, with only its worker's ``key`` part as the value."""
    return [SimpleNamespace(rank=r.rank, exitcode=r.exitcode, error=r.error,
                            value=r.value[key] if r.exitcode == 0 else None) for r in results]


# ---------------------------------------------------------------- K=2 / K=4 grid
GRID = [(M, s) for M in (1, 4, 8) for s in ("gpipe", "1f1b")]


def grid_worker(rank: int, world: int) -> list:
    out = []
    x, y = batch(16)
    for M, schedule in GRID:
        pipe = DistributedGPipe(mlp(), partitions=world, chunks=M, schedule=schedule, seed=5)
        loss = pipe.train_step(x, y, F.mse_loss)
        timeline = pipe.gather_timeline()
        kinds = sorted((e.stage, e.kind) for e in timeline.events if e.kind in "FB")
        out.append((loss.item(), local_grads(pipe), pipe.memory()[0], timeline.measured_bubble(), kinds))
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_grid_equals_unpipelined(world: int, request: pytest.FixtureRequest) -> None:
    results = part(request.getfixturevalue(f"world{world}"), "grid")
    expected_loss, expected_grads = reference(mlp(), *batch(16))
    for key, (M, schedule) in enumerate(GRID):
        check(results, expected_loss, expected_grads, key)
        bubbles = {r.value[key][3] for r in results}
        assert len(bubbles) == 1  # the same gathered timeline on every rank
        kinds = results[0].value[key][4]
        assert kinds == sorted((k, kind) for k in range(world) for kind in "FB" for _ in range(M))
        for r in results:
            live = r.value[key][2]["peak_live_microbatches"]
            if schedule == "gpipe":
                assert live == M
            else:
                assert live <= world - r.rank


SPLIT = ("zb-h1", "zb-h2", "gpipe-bw", "zb-v", "dualpipev")
V_SHAPED = ("zb-v", "dualpipev")  # two stages per rank in a V: rank r holds stages r and 2K-1-r


def split_worker(rank: int, world: int) -> list:
    x, y = batch(16)
    out = []
    for schedule in SPLIT:
        v = 2 if schedule in V_SHAPED else 1
        pipe = DistributedGPipe(mlp(), partitions=world, chunks=4, schedule=schedule, seed=5, virtual_stages=v)
        loss = pipe.train_step(x, y, F.mse_loss).item()
        grads = local_grads(pipe)
        # the forward-only path runs fill-drain over the same placement; every rank gets the output
        out.append((loss, grads, sorted(j for j, _ in pipe._chunks.items()), pipe(x), None))
    return out


def test_split_backward_schedules_equal_unpipelined(world2: list) -> None:
    """zb-h1, zb-h2, gpipe-bw (W batched over micro-batches), zb-v and dualpipev on 2 gloo ranks."""
    results = part(world2, "split")
    model = mlp()
    x, y = batch(16)
    with torch.no_grad():
        expected_out = model(x)
    expected_loss, expected_grads = reference(model, x, y)
    for key, schedule in enumerate(SPLIT):
        check(results, expected_loss, expected_grads, key)
        for r in results:
            torch.testing.assert_close(r.value[key][3], expected_out, atol=1e-5, rtol=1e-5)
        if schedule in V_SHAPED:  # the V placement: rank 0 holds the first and the last stage
            assert [r.value[key][2] for r in results] == [[0, 3], [1, 2]]


# ---------------------------------------------------------------- D=2 × K=2
def dp_worker(rank: int, world: int) -> list:
    x, y = batch(16)
    pipe = DistributedGPipe(mlp(), partitions=2, chunks=4, schedule="1f1b", seed=5, bucket_bytes=600)
    d = pipe.dp_rank
    loss = pipe.train_step(x[8 * d:8 * d + 8], y[8 * d:8 * d + 8], F.mse_loss)
    state = pipe.full_state_dict()
    pipe.load_full_state_dict({k: torch.zeros_like(v) for k, v in mlp().state_dict().items()})
    zeroed = all(float(p.abs().sum()) == 0 for p in pipe.parameters())
    return [(loss.item(), local_grads(pipe), state, zeroed, (pipe.dp_rank, pipe.dp_size, pipe.stage_index))]


@pytest.mark.slow
def test_data_parallel_pipeline_equals_global_batch(world4: list) -> None:
    results = part(world4, "dp")
    expected_loss, expected_grads = reference(mlp(), *batch(16))
    check(results, expected_loss, expected_grads, 0)
    assert [r.value[0][4] for r in results] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    state = results[0].value[0][2]
    torch.testing.assert_close(state, mlp().state_dict())
    assert all(r.value[0][2] is None for r in results[1:])
    assert all(r.value[0][3] for r in results)


# ---------------------------------------------------------------- shapes, meta, eval, interleaved
class Tag(nn.Module):
    """(B, T, W) -> ((B, T, W), lengths int64): a tuple boundary with a non-float member."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.full((x.shape[0],), x.shape[1], dtype=torch.int64)


class TupleLinear(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = value
        return torch.tanh(self.lin(x)) * lengths[:, None, None].float() / 10, lengths


class First(nn.Module):
    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return value[0]


def seq_model() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 8), Tag(), TupleLinear(8), TupleLinear(8), First())


SHAPES = [(12, 5), (7, 3), (12, 9)]  # (batch, sequence length) per step: a smaller last batch too


def misc_worker(rank: int, world: int) -> dict:
    out: dict = {"shapes": []}
    pipe = DistributedGPipe(seq_model(), balance=[2, 3], chunks=3, schedule="1f1b", seed=5)
    for step, (n, t) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(n, t, 8, generator=g), torch.randn(n, t, 8, generator=g)
        for p in pipe.parameters():
            p.grad = None
        out["shapes"].append((pipe.train_step(x, y, F.mse_loss).item(), local_grads(pipe)))
    meta = DistributedGPipe(lambda: mlp(), options=PipelineOptions(partitions=2, chunks=2, seed=11))
    x, y = batch(6)
    out["meta"] = (meta.train_step(x, y, F.mse_loss).item(), local_grads(meta))
    out["eval"] = meta.forward(x)
    for v_schedule in ("gpipe", "1f1b"):
        pipe = DistributedGPipe(mlp(blocks=8), partitions=2, virtual_stages=2, chunks=4,
                                schedule=v_schedule, checkpoint="never", seed=5)
        out[v_schedule] = (pipe.train_step(*batch(16), F.mse_loss).item(), local_grads(pipe))
    for schedule in ("gpipe", "zb-h1"):  # a last batch of 3 samples with chunks=8 trains on 3 micro-batches
        pipe = DistributedGPipe(mlp(), partitions=2, chunks=8, schedule=schedule, seed=5)
        loss = pipe.train_step(*batch(3), F.mse_loss)
        out["short-" + schedule] = (loss.item(), local_grads(pipe), pipe.gather_timeline().num_microbatches)
    # costs that differ between ranks (as measured times do): every rank cuts where rank 0 does
    cut = DistributedGPipe(mlp(), partitions=2, chunks=2, seed=5, cost=[1, 1, 1, 5] if rank == 0 else [5, 1, 1, 1])
    out["disagreeing-costs"] = (cut.train_step(*batch(6), F.mse_loss).item(), local_grads(cut), cut.balance)
    x, y = batch(4)
    out["views"] = (pipe.chunks, pipe.checkpoint, pipe.balance, len(pipe.partitions), pipe.devices)
    try:
        pipe(x, broadcast=True).sum().backward()
        out["backward"] = "no error"
    except RuntimeError as exc:
        out["backward"] = str(exc)
    return out


def test_shapes_meta_eval_and_interleaved(world2: list) -> None:
    results = part(world2, "misc")
    for r in results:
        assert r.exitcode == 0, r.error
    for step, (n, t) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(n, t, 8, generator=g), torch.randn(n, t, 8, generator=g)
        check([_pick(r, "shapes", step) for r in results], *reference(seq_model(), x, y), 0)
    x, y = batch(6)
    model = seeded_init(mlp(), 11)
    check([_pick(r, "meta") for r in results], *reference(model, x, y), 0)
    for r in results:
        torch.testing.assert_close(r.value["eval"], model(x).detach())
    for v_schedule in ("gpipe", "1f1b"):
        check([_pick(r, v_schedule) for r in results], *reference(mlp(blocks=8), *batch(16)), 0)
    for schedule in ("gpipe", "zb-h1"):
        check([_pick(r, "short-" + schedule) for r in results], *reference(mlp(), *batch(3)), 0)
        assert all(r.value["short-" + schedule][2] == 3 for r in results)  # the M actually used
    check([_pick(r, "disagreeing-costs") for r in results], *reference(mlp(), *batch(6)), 0)
    assert [r.value["disagreeing-costs"][2] for r in results] == [[3, 1], [3, 1]]
    for r in results:
        assert r.value["views"] == (8, "except_last", [2, 2], 1, [torch.device("cpu")])
        assert "use pipe.train_step" in r.value["backward"]


class _Picked:
    def __init__(self, value: object) -> None:
        self.exitcode, self.error, self.value = 0, None, [value]


def _pick(result: object, key: str, index: int | None = None) -> _Picked:
    value = result.value[key]
    return _Picked(value if index is None else value[index])


def environment_worker(rank: int, world: int, name: str) -> tuple[str | None, str, int]:
    import os

    return os.environ.get(name), os.getcwd(), torch.get_num_threads()


def test_workers_start_from_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """Forked from a server started earlier, a worker still sees what the caller set just now."""
    run_local(environment_worker, 1, args=("GPIPE_TEST_UNSET",), timeout=60)  # the server is up
    monkeypatch.setenv("GPIPE_TEST_LATE", "late")
    monkeypatch.chdir(tmp_path)
    results = run_local(environment_worker, 2, args=("GPIPE_TEST_LATE",), timeout=60, threads=1)
    assert [r.exitcode for r in results] == [0, 0], [r.error for r in results]
    assert [r.value for r in results] == [("late", str(tmp_path), 1)] * 2


def test_a_bad_start_method_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"start_method must be one of \['forkserver', 'spawn'\], got 'fork'"):
        run_local(environment_worker, 1, args=("X",), start_method="fork")

"""``compile``: compiled stages give the eager pipeline's loss and gradients (within 1e-4).

Compilation is slow on a 2-core CPU, so the model matrix (the MLP at every K ∈ {1, 2} ×
M ∈ {1, 4}; ``transformer_tiny`` at K=1 M=4 and K=2 M=1; ``amoebanet_d_tiny``, whose cells
trace the most ops, once, at K=2 M=4) compiles with the ``aot_eager`` backend
(dynamo's capture and AOT autograd's compiled backward, without Inductor's code
generation), and one test runs the default Inductor backend on the smallest model. The
presets are built with small overrides (``SMALL``, one Transformer layer): dynamo's
and AOT autograd's time grows with the number of traced ops. A stage that dynamo silently
leaves eager would make the comparison trivial, so the matrix also checks that dynamo
captured graphs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch._dynamo import reset as reset_dynamo
from torch._dynamo.utils import counters

from gpipe_lab.models import example_input
from gpipe_lab.models.losses import translation_loss
from gpipe_lab.models.preset_registry import build
from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.options import OptionError
from gpipe_lab.pipeline.stage.random_replay import UnreplayableRandomError
from helpers.models import grads, mlp

AOT = {"backend": "aot_eager"}
BATCH = 8
TOL = dict(atol=1e-4, rtol=1e-4)
#: Small overrides of the presets: AmoebaNet's traced op count is fixed by its cells
#: (num_layers=3 is its minimum), so only its sizes shrink; one Transformer layer halves its ops.
SMALL: dict[str, dict] = {
    "amoebanet_d_tiny": dict(num_filters=8, image_size=8),
    "transformer_tiny": dict(num_layers=1, d_model=16, ffn_dim=32, num_heads=2, vocab_size=16, seq_len=4),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Drop dynamo's process-wide caches after each test.

    Its code and fake-tensor caches keep every compiled pipeline's traces (hundreds of
    thousands of objects for AmoebaNet), so each later garbage collection, in this file's
    later compiles and in every later test file, walks a larger heap.
    """
    yield
    reset_dynamo()


def _mlp_with_dropout(depth: int = 4) -> nn.Sequential:
    model = mlp(depth=depth)
    model.insert(depth // 2, nn.Dropout(0.3))  # a draw that re-materialization must repeat
    return model


def _case(name: str) -> tuple:
    """(model factory, input, target, loss) for one of the three test models."""
    if name == "mlp":
        torch.manual_seed(1)
        return _mlp_with_dropout, torch.randn(BATCH, 8), torch.randn(BATCH, 8), nn.functional.mse_loss

    def factory() -> nn.Sequential:
        torch.manual_seed(0)
        return build(name, **SMALL[name])

    x = example_input(factory(), BATCH, "cpu")
    if name.startswith("transformer"):
        torch.manual_seed(2)
        logits = factory()(x)
        return factory, x, torch.randint(4, logits.shape[-1], logits.shape[:-1]), translation_loss()
    torch.manual_seed(2)
    return factory, x, torch.randint(0, 10, (BATCH,)), nn.functional.cross_entropy


def _step(pipe: GPipe, x: object, y: object, loss_fn: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in pipe.module.parameters():
        p.grad = None
    loss = pipe.train_step(x, y, loss_fn)
    return loss.detach(), grads(pipe.module)


def _assert_close(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], **TOL)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, **TOL)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


# capturing a real model takes seconds per pipeline here: two corners each, which between
# them cover K=1, K=2, M=1 and M=4 (the MLP runs all four). AmoebaNet runs without
# re-materialization: one graph per stage instead of two (grad and no-grad forwards, 7 s each
# here); the MLP and the Transformer cover compile x re-materialization.
MATRIX = [("mlp", K, M) for K in (1, 2) for M in (1, 4)] + [
    ("transformer_tiny", 1, 4), ("transformer_tiny", 2, 1)] + [
    pytest.param("amoebanet_d_tiny", 2, 4, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("name", "K", "M"), MATRIX)
def test_compiled_matches_eager(name: str, K: int, M: int) -> None:
    factory, x, y, loss_fn = _case(name)
    checkpoint = "never" if name.startswith("amoebanet") else "except_last"
    options = dict(partitions=K, chunks=M, seed=5, checkpoint=checkpoint)
    eager, compiled = GPipe(factory(), **options), GPipe(factory(), compile=AOT, **options)
    before = _graphs()
    for _ in range(2):  # the second step runs the compiled graphs (the first is checked eagerly)
        want, got = _step(eager, x, y, loss_fn), _step(compiled, x, y, loss_fn)
        _assert_close(got, want)
        with torch.no_grad():  # keep both models equal for the next step
            for p, q in zip(compiled.module.parameters(), eager.module.parameters(), strict=True):
                p.copy_(q)
    assert _graphs() > before, "dynamo captured no graph: the stages ran eagerly"


@pytest.mark.parametrize(("schedule", "checkpoint"), [("gpipe", "always"), ("1f1b", "never"),
                                                      ("1f1b", "except_last")])
def test_compiled_schedules_and_checkpoint_modes(schedule: str, checkpoint: str) -> None:
    _, x, y, loss_fn = _case("mlp")
    options = dict(partitions=2, chunks=4, seed=9, schedule=schedule, checkpoint=checkpoint)
    eager = GPipe(_mlp_with_dropout(), **options)
    compiled = GPipe(_mlp_with_dropout(), compile=AOT, **options)
    for _ in range(2):
        _assert_close(_step(compiled, x, y, loss_fn), _step(eager, x, y, loss_fn))


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "gpipe-bw"])
def test_split_backward_schedules_are_refused_by_name(schedule: str) -> None:
    with pytest.raises(OptionError, match=f"compile: schedule '{schedule}' splits the backward"):
        GPipe(mlp(), partitions=2, schedule=schedule, compile=AOT)


def _conv_bn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 10))


def test_compiled_deferred_batch_norm() -> None:
    """Running statistics and gradients agree with the eager pipeline's under deferred BN."""
    factory, x, y, loss_fn = _conv_bn, torch.randn(BATCH, 3, 4, 4), torch.randint(0, 10, (BATCH,)), \
        nn.functional.cross_entropy
    options = dict(partitions=2, chunks=4, seed=3, deferred_batch_norm=True, checkpoint="always")
    eager, compiled = GPipe(factory(), **options), GPipe(factory(), compile=AOT, **options)
    for _ in range(2):
        _assert_close(_step(compiled, x, y, loss_fn), _step(eager, x, y, loss_fn))
    stats = [(n, b) for n, b in compiled.module.named_buffers() if "running" in n]
    assert stats
    for (name, got), want in zip(stats, [b for n, b in eager.module.named_buffers() if "running" in n]):
        torch.testing.assert_close(got, want, **TOL, msg=name)


def test_inductor_matches_eager() -> None:
    """The default backend (Inductor's generated kernels) on the smallest model."""
    _, x, y, loss_fn = _case("mlp")
    options = dict(partitions=2, chunks=4, seed=4)
    # two blocks and the dropout between them: each stage is one Inductor kernel set to build
    eager, compiled = GPipe(_mlp_with_dropout(2), **options), GPipe(_mlp_with_dropout(2), compile=True, **options)
    before = _graphs()
    for _ in range(2):
        _assert_close(_step(compiled, x, y, loss_fn), _step(eager, x, y, loss_fn))
    assert _graphs() > before


class _Noise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


def test_unreplayable_draw_in_a_compiled_stage_is_refused() -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), _Noise(), nn.Linear(4, 4)), partitions=1, compile=AOT)
    with pytest.raises(UnreplayableRandomError, match=r"_Noise.*rand.*compile=false"):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)


@pytest.mark.parametrize(("value", "match"), [("yes", "compile: must be true, false or a dict"),
                                              ({"modee": "max-autotune"}, "'modee' is not a torch.compile keyword")])
def test_bad_compile_option_is_named(value: object, match: str) -> None:
    with pytest.raises(OptionError, match=match):
        GPipe(mlp(), partitions=2, compile=value)

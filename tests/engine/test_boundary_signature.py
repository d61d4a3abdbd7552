"""Stage boundary signatures (``stage/boundary.py``): a stage whose outputs change dtype, shape beyond
the batch dimension or number between steps under the same conditions raises a clear error naming both
stages and both signatures, on both transports; a change of batch size, of the inputs' sequence length
or of the layers' mode stays allowed, and the result is the unpipelined model's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab import GPipe
from gpipe_lab.pipeline import BoundaryChangedError
from gpipe_lab.pipeline.distributed import DistributedGPipe
from gpipe_lab.pipeline.distributed.spawn import run_local
from gpipe_lab.pipeline.stage.boundary import show, signature


class Switch(nn.Module):
    """Identity until ``change`` is set: then its output changes dtype, shape or number."""

    def __init__(self) -> None:
        super().__init__()
        self.change: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.change == "dtype":
            return x.double()
        if self.change == "shape":
            return x[:, :3]
        if self.change == "number":
            return x, x
        return x


def switching_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Switch(), nn.Linear(4, 4))


CHANGED = {"dtype": "(float64[*, 4])", "shape": "(float32[*, 3])", "number": "(float32[*, 4], float32[*, 4])"}


def test_signature_text_names_dtype_and_shape_beyond_the_batch() -> None:
    sig = signature((torch.zeros(5, 2, 3), None, torch.zeros((), dtype=torch.int64)))
    assert show(sig) == "(float32[*, 2, 3], None, int64[])"
    assert signature((torch.zeros(7, 2, 3),)) == signature((torch.zeros(1, 2, 3),))  # batch size is free


@pytest.mark.parametrize("change", list(CHANGED))
def test_a_changed_boundary_value_raises_naming_both_stages_and_signatures(change: str) -> None:
    model = switching_model()
    pipe = GPipe(model, balance=[2, 1], chunks=2, checkpoint="never")
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.train_step(x, y, F.mse_loss)
    model[1].change = change
    with pytest.raises(BoundaryChangedError) as caught:
        pipe.train_step(x, y, F.mse_loss)
    message = str(caught.value)
    assert f"stage 0 now sends {CHANGED[change]} to stage 1, which received (float32[*, 4])" in message
    assert "from the same inputs (float32[*, 4])" in message and "[in stage 0, forward of micro-batch 0]" in message


def test_batch_size_sequence_length_and_mode_may_change_and_match_the_unpipelined_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.0), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 2))
    reference = copy.deepcopy(model)
    pipe = GPipe(model, balance=[2, 2, 1], chunks=4, checkpoint="never")
    for batch, length in [(8, 5), (3, 5), (1, 5), (6, 2), (8, 5)]:
        x, y = torch.randn(batch, length, 6), torch.randn(batch, length, 2)
        for p in list(model.parameters()) + list(reference.parameters()):
            p.grad = None
        loss = pipe.train_step(x, y, F.mse_loss)
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    pipe.eval()
    x = torch.randn(5, 3, 6)
    torch.testing.assert_close(pipe.forward_only(x), reference.eval()(x), rtol=1e-5, atol=1e-5)


def switching_worker(rank: int, world: int) -> None:
    """One good step, then stage 0's output turns float64 (every rank runs the same model)."""
    model = switching_model()
    pipe = DistributedGPipe(model, balance=[2, 1], chunks=2, checkpoint="never", timeout=30.0, seed=0)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.train_step(x if rank == 0 else None, y, F.mse_loss)
    model[1].change = "dtype"
    pipe.train_step(x if rank == 0 else None, y, F.mse_loss)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_changed_boundary_value_raises_on_the_distributed_transport() -> None:
    results = run_local(switching_worker, 2, timeout=60)
    assert results[0].error_type == "BoundaryChangedError", results[0].error
    for r in results:  # the receiving rank stops too, naming the sender's error
        assert r.exitcode == 1 and r.error is not None
        assert "stage 0 now sends (float64[*, 4]) to stage 1, which received (float32[*, 4])" in r.error, r.error

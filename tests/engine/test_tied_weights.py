"""A weight shared by two layers of one stage stays one weight through materialization.

Torch converts module by module (``to_empty``, ``to("meta")``), which gives each holder of a
shared parameter a copy of its own. A meta-built model would then train two weights where
the unpipelined model trains one, and on the distributed transport the ranks that do not
hold the tied layers would see one parameter more than the user's model has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline import GPipe, seeded_init
from gpipe_lab.pipeline.partitioning.materialize import local_chunks


def tied() -> nn.Sequential:
    """Layers 2 and 4 share one weight; a cut must not separate them."""
    shared, again = nn.Linear(6, 6), nn.Linear(6, 6)
    again.weight = shared.weight
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), shared, nn.Tanh(), again, nn.Tanh(), nn.Linear(6, 3))


def test_a_meta_built_tied_weight_is_one_weight_and_trains_like_the_unpipelined_model() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    pipe = GPipe(tied, balance=[5, 2], chunks=2, seed=3)  # built on meta, allocated per stage
    stage0 = pipe.partitions[0]
    assert stage0[2].weight is stage0[4].weight
    reference = seeded_init(tied(), 3)
    for got, want in zip(pipe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    loss = pipe.train_step(x, y, F.mse_loss)
    plain = sum(F.mse_loss(reference(a), b) for a, b in zip(x.chunk(2), y.chunk(2))) / 2
    plain.backward()
    torch.testing.assert_close(loss, plain.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip(pipe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


def test_layers_released_to_meta_keep_their_ties() -> None:
    model = tied()
    count = len(list(model.parameters()))
    local_chunks(model, [5, 2], [1], torch.device("cpu"), seed=0)  # this rank holds the last two layers
    assert model[2].weight.is_meta and model[2].weight is model[4].weight
    assert len(list(model.parameters())) == count


def test_a_tied_rnn_weight_is_rebuilt_in_the_rnn_cache() -> None:
    def factory() -> nn.Sequential:
        rnn, again = nn.RNN(3, 3, batch_first=True), nn.RNN(3, 3, batch_first=True)
        again.weight_hh_l0 = rnn.weight_hh_l0
        return nn.Sequential(Outputs(rnn), Outputs(again))

    pipe = GPipe(factory, balance=[2], chunks=1, seed=0)
    first, second = pipe.partitions[0][0].rnn, pipe.partitions[0][1].rnn
    assert first.weight_hh_l0 is second.weight_hh_l0
    assert any(w is first.weight_hh_l0 for w in second._flat_weights)
    assert pipe(torch.randn(2, 5, 3)).shape == (2, 5, 3)


class Outputs(nn.Module):
    """An RNN's output sequence only."""

    def __init__(self, rnn: nn.RNN) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]

"""Memory counting (``track_memory``): counted once per forward signature, reused after, and
never in the way of the backward.

Saved-tensor hooks also switch off autograd's check that a saved tensor was not changed in
place, so a forward charged from the memo (no hooks) is held to that check: plain BatchNorm
under re-materialization restores its running statistics after the replay without tripping it.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gpipe_lab.pipeline import GPipe
from gpipe_lab.pipeline.measuring.saved_bytes import SavedBytes
from gpipe_lab.pipeline.options import OptionError


def _bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def _batch(n: int = 8, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.fixture
def hook_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many forwards ran under the counting hooks."""
    calls: list[int] = []
    original = SavedBytes.hooks

    def counted(self: SavedBytes):  # noqa: ANN202
        calls.append(1)
        return original(self)

    monkeypatch.setattr(SavedBytes, "hooks", counted)
    return calls


@pytest.mark.parametrize("track_memory", [True, "every_step", False])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_plain_batchnorm_matches_gradient_accumulation_whatever_the_counting(checkpoint: str,
                                                                            track_memory: bool | str) -> None:
    reference, piped = _bn_net(), _bn_net()
    pipe = GPipe(piped, balance=[3, 5], chunks=4, checkpoint=checkpoint, devices=["cpu", "cpu"],
                 track_memory=track_memory)
    for step in range(2):
        x, y = _batch(seed=step)
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            (F.cross_entropy(reference(xs), ys) / 4).backward()
        pipe.train_step(x, y, F.cross_entropy)
    for (name, a), b in zip(reference.named_parameters(), piped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    for (name, a), b in zip(reference.named_buffers(), piped.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_a_repeated_signature_is_charged_without_hooks_and_reports_the_same_peak(hook_blocks: list[int]) -> None:
    counted = GPipe(_bn_net(), balance=[3, 5], chunks=4, checkpoint="except_last", devices=["cpu", "cpu"],
                    track_memory="every_step")
    memo = GPipe(_bn_net(), balance=[3, 5], chunks=4, checkpoint="except_last", devices=["cpu", "cpu"])
    x, y = _batch()
    counted.train_step(x, y, F.cross_entropy)
    every = len(hook_blocks)
    assert every == 2 * (4 + 3)  # on each stage: 4 forwards, and the replays of the 3 checkpointed ones
    peaks = [row["peak_activation_bytes"] for row in counted.memory()]
    assert min(peaks) > 0
    del hook_blocks[:]
    for step in range(3):
        memo.train_step(*_batch(seed=step), F.cross_entropy)
        assert [row["peak_activation_bytes"] for row in memo.memory()] == peaks
        # first step, on each stage: a checkpointed forward, the last (kept) one, a replay
        assert len(hook_blocks) == (2 * 3 if step == 0 else 0)
        del hook_blocks[:]


def test_a_new_shape_or_a_frozen_layer_is_counted_again(hook_blocks: list[int]) -> None:
    net = _bn_net()
    pipe = GPipe(net, balance=[3, 5], chunks=2, checkpoint="never", devices=["cpu", "cpu"])
    exact = GPipe(_bn_net(), balance=[3, 5], chunks=2, checkpoint="never", devices=["cpu", "cpu"],
                  track_memory="every_step")
    pipe.train_step(*_batch(8), F.cross_entropy)
    del hook_blocks[:]
    pipe.train_step(*_batch(6), F.cross_entropy)  # micro-batches of 3 rows: a new signature
    assert len(hook_blocks) == 2
    exact.train_step(*_batch(6), F.cross_entropy)
    assert pipe.memory() == exact.memory()
    del hook_blocks[:]
    for module in (net[0], exact.module[0]):  # a frozen first conv saves no input for its weight
        module.requires_grad_(False)
    pipe.train_step(*_batch(6), F.cross_entropy)
    assert len(hook_blocks) == 1  # stage 0's parameters changed; stage 1's signature is known
    exact.train_step(*_batch(6), F.cross_entropy)
    assert pipe.memory() == exact.memory()


class _KeepPositive(nn.Module):
    """Saves a tensor whose size depends on the values: what ``every_step`` is for."""

    def forward(self, x: Tensor) -> Tensor:
        kept = x[x > 0]
        return x * (kept * kept).sum()


@pytest.mark.parametrize("setting", [True, "every_step"])
def test_every_step_counts_saved_tensors_whose_size_depends_on_values(setting: bool | str) -> None:
    pipe = GPipe(nn.Sequential(nn.Identity(), _KeepPositive()), balance=[1, 1], chunks=1,
                 devices=["cpu", "cpu"], checkpoint="never", track_memory=setting)
    peaks = []
    for negative in (0, 48):  # 64 values, all kept, then 16 of them
        x = torch.ones(16, 4)
        x.view(-1)[:negative] = -1.0
        pipe.train_step(x, torch.zeros(16), lambda out, _: out.sum())
        peaks.append(pipe.memory()[1]["peak_activation_bytes"])
    if setting == "every_step":
        assert peaks[0] - peaks[1] == 48 * 4  # ``kept`` (saved twice by ``kept * kept``: one view, counted once)
    else:  # the documented limit of counting once per signature: the first count is reused
        assert peaks[0] == peaks[1]


@pytest.mark.parametrize("value", ["sometimes", 1, None])
def test_a_bad_track_memory_names_the_value_and_the_allowed_ones(value: object) -> None:
    with pytest.raises(OptionError, match=r"track_memory: must be one of \[True, 'every_step', False\], got "
                                          + repr(value).replace("(", r"\(")):
        GPipe(nn.Sequential(nn.Linear(2, 2)), balance=[1], chunks=1, devices=["cpu"], track_memory=value)

"""Host syncs in a local step: the non-finite verdict over all stages is the step's one device read
(none under ``nonfinite="ignore"``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from gpipe_lab.pipeline import GPipe, NonFiniteError, all_finite
from gpipe_lab.pipeline.step.nonfinite import nonfinite_flag

# every Python-level way to read a tensor's value on the host (each one a sync on CUDA)
_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def counted_reads() -> Iterator[list[str]]:
    """Counts host reads of tensor values in every thread while the block runs."""
    seen: list[str] = []
    lock = threading.Lock()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name: str):  # noqa: ANN202 - a wrapper of any signature
        original = originals[name]

        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            with lock:
                seen.append(name)
            return original(self, *args, **kwargs)

        return read

    try:
        for name in _READS:
            setattr(torch.Tensor, name, counting(name))
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.ReLU(),
                         nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("nonfinite", ["raise", "skip", "ignore"])
def test_a_local_step_reads_the_device_once(nonfinite: str) -> None:
    pipe = GPipe(model(), partitions=3, chunks=4, nonfinite=nonfinite, deferred_batch_norm=True)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    pipe.train_step(x, y, nn.functional.mse_loss)  # first step: lazy set-up out of the count
    with counted_reads() as seen:
        pipe.train_step(x, y, nn.functional.mse_loss)
    assert seen == ([] if nonfinite == "ignore" else ["tolist"]), seen  # "ignore" judges nothing


def test_the_single_read_still_names_the_bad_stage() -> None:
    pipe = GPipe(model(), partitions=3, chunks=2, nonfinite="skip", deferred_batch_norm=True)
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    # stage 1's gradients turn NaN while the loss stays finite
    next(pipe.partitions[1].parameters()).register_hook(lambda g: g * float("nan"))
    pipe.train_step(x, y, nn.functional.mse_loss)
    assert pipe.last_step_skipped and all(p.grad is None for p in pipe.parameters())
    pipe.options = pipe.options.replace(nonfinite="raise")
    with pytest.raises(NonFiniteError, match="gradients of stage 1 are not finite"):
        pipe.train_step(x, y, nn.functional.mse_loss)


def test_flags_need_no_read_and_do_not_overflow() -> None:
    big = torch.full((1000,), 3e38)  # a sum would overflow to inf: still finite
    assert all_finite([big, None]) and all_finite([torch.full((10,), 6e4, dtype=torch.float16)])
    assert not all_finite([big, torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([-float("inf")], dtype=torch.bfloat16)])
    assert nonfinite_flag([None]) is None and all_finite([])
    with counted_reads() as seen:
        flag = nonfinite_flag([big, torch.tensor([float("inf")])])
    assert not seen and flag.dtype == torch.bool


def test_a_tensor_loss_normalizer_is_not_read_before_the_launch() -> None:
    """``count_tokens`` returns a device tensor: its value reaches the loss on the device, and the
    verdict stays the step's one read; a count that is not positive makes the loss NaN, reported."""
    pipe, read = (GPipe(model(), partitions=3, chunks=4, deferred_batch_norm=True, seed=0) for _ in "ab")
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target, reduction="sum")

    def positives(t: torch.Tensor) -> torch.Tensor:
        return (t > 0).sum()

    pipe.train_step(x, y, summed, loss_normalizer=positives)
    with counted_reads() as seen:
        loss = pipe.train_step(x, y, summed, loss_normalizer=positives)
    assert seen == ["tolist"], seen
    for _ in range(2):  # the same steps with the count read on the host first
        expected = read.train_step(x, y, summed, loss_normalizer=lambda t: float(positives(t)))
    assert loss.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for p, q in zip(pipe.parameters(), read.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(NonFiniteError, match="loss is nan"):
        pipe.train_step(x, y, summed, loss_normalizer=lambda t: (t > 1e9).sum())
    with pytest.raises(ValueError, match="loss_normalizer returned 0.0; it must be positive"):
        pipe.train_step(x, y, summed, loss_normalizer=lambda t: 0.0)


def test_the_translators_token_count_is_not_read_per_step() -> None:
    """The Lightning runner counts each batch's tokens for throughput: left on the targets' device,
    it is read only when ``PipelineMetrics`` logs, not once more per step."""
    from gpipe_lab.lightning.modules import Translator
    from gpipe_lab.models import build

    translator = Translator(build("transformer_tiny"))
    targets = torch.tensor([[5, 6, 0], [7, 0, 0]])
    with counted_reads() as seen:
        samples, tokens = translator.count_samples((torch.zeros(2, 3),), targets)
    assert not seen, seen
    assert samples == 2 and isinstance(tokens, torch.Tensor) and int(tokens) == (targets != 0).sum().item()


def test_a_distributed_step_reads_the_device_once(tmp_path) -> None:  # noqa: ANN001 - pytest's path
    """The distributed transport too: the shared verdict is the step's one read, with a tensor
    ``loss_normalizer`` (a one-rank gloo world)."""
    import torch.distributed as dist

    from gpipe_lab.pipeline.distributed import DistributedGPipe

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        pipe = DistributedGPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), partitions=1, chunks=2)
        x, y = torch.randn(4, 4), torch.randn(4, 2)

        def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(out, target, reduction="sum")

        pipe.train_step(x, y, summed, loss_normalizer=lambda t: (t > 0).sum())
        with counted_reads() as seen:
            pipe.train_step(x, y, summed, loss_normalizer=lambda t: (t > 0).sum())
        assert seen == ["tolist"], seen
    finally:
        dist.destroy_process_group()

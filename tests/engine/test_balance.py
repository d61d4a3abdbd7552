"""balance_by_time / balance_by_size: no side effects, training-mode profile, a sensible balance.

Profiling must leave the module as it was: parameters, existing ``.grad``
(preserved, the same tensor), BatchNorm running statistics and
``num_batches_tracked``, training/eval flags, and the RNG state.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gpipe_lab.pipeline import balance_by_cost, balance_by_size, balance_by_time, layer_costs

pytestmark = pytest.mark.timeout(120)
BALANCERS = [balance_by_time, balance_by_size]


class Recorder(nn.Module):
    """Records the mode and grad mode of each forward, and each backward through it."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards: list[tuple[bool, bool]] = []
        self.backwards = 0

    def forward(self, x: Tensor) -> Tensor:
        self.forwards.append((self.training, torch.is_grad_enabled()))
        y = x * 1.0
        if y.requires_grad:
            y.register_hook(self._count)
        return y

    def _count(self, grad: Tensor) -> None:
        self.backwards += 1


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(),
                         nn.Linear(16, 16), nn.BatchNorm1d(16), Recorder(), nn.Linear(16, 4))


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [p.grad for p in model.parameters()],
        "grad_values": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "modes": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_same(before: dict, model: nn.Module) -> None:
    after = snapshot(model)
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), k
    assert all(a is b for a, b in zip(before["grads"], after["grads"]))  # the same tensors
    for a, b in zip(before["grad_values"], after["grad_values"]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert before["modes"] == after["modes"]
    assert torch.equal(before["rng"], after["rng"])


@pytest.mark.parametrize("balance", BALANCERS)
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("with_grads", [False, True])
def test_profiling_leaves_no_trace(balance, mode: str, with_grads: bool) -> None:
    model = bn_model()
    model.train(mode == "train")
    model[4].eval()  # a mixed-mode module keeps each flag
    if with_grads:
        model(torch.randn(6, 8)).sum().backward()
    sample = torch.randn(32, 8)
    before = snapshot(model)
    parts = balance(model, sample, 3)
    assert sum(parts) == len(model) and len(parts) == 3
    assert_same(before, model)


@pytest.mark.parametrize("balance", BALANCERS)
def test_profiles_in_training_mode_with_backward(balance) -> None:
    model = bn_model().eval()
    recorder = model[6]
    with torch.no_grad():  # the caller's grad mode does not matter either
        balance(model, torch.randn(16, 8), 2)
    assert recorder.forwards and all(training and grad for training, grad in recorder.forwards)
    if balance is balance_by_time:
        assert recorder.backwards == len(recorder.forwards)


class Saver(nn.Module):
    """No parameters, but saves a large activation for its backward."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(x.repeat(1, 64)).reshape(x.shape[0], 64, -1).mean(1)


def test_balance_by_size_counts_saved_activations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Saver(), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    sample = torch.randn(64, 8)
    assert balance_by_cost(layer_costs(model, "params"), 2) == [3, 2]
    assert balance_by_size(model, sample, 2, param_scale=2.0) == [2, 3]
    saved = layer_costs(model, "activation_bytes", sample)
    assert saved[0] == 64 * 8 * 4  # Linear saves its input, not its weight
    assert saved[1] >= 64 * 8 * 64 * 4  # exp saves its [64, 512] float32 result


def test_errors_name_the_value() -> None:
    model = bn_model()
    with pytest.raises(ValueError, match=r"partitions must be an integer in \[1, 8\].*got 9"):
        balance_by_time(model, torch.randn(4, 8), 9)
    with pytest.raises(TypeError, match="sample must be a tensor.*list"):
        balance_by_size(model, [torch.randn(4, 8)], 2)
    with pytest.raises(ValueError, match="repeat must be an integer >= 1, got 0"):
        balance_by_time(model, torch.randn(4, 8), 2, repeat=0)
    with pytest.raises(ValueError, match="param_scale must be >= 0, got -1"):
        balance_by_size(model, torch.randn(4, 8), 2, param_scale=-1)
    with pytest.raises(ValueError, match="cost 'flops' is measured on a sample batch: pass sample="):
        layer_costs(model, "flops")
    with pytest.raises(ValueError, match="cost 'time' is measured on a sample batch: pass sample="):
        layer_costs(model, "time")
    with pytest.raises(ValueError, match=r"unknown cost 'speed'; allowed: 'auto', 'params'.*'time'\] with sample="):
        layer_costs(model, "speed", torch.randn(4, 8))


class Tick(nn.Module):
    """Advances a fake clock by ``cost`` per forward (``warmup`` more on its first), counts backwards."""

    def __init__(self, clock: list[float], cost: float, warmup: float = 0.0) -> None:
        super().__init__()
        self.clock, self.cost, self.warmup = clock, cost, warmup
        self.linear = nn.Linear(4, 4)
        self.forwards = self.backwards = 0

    def forward(self, x: Tensor) -> Tensor:
        self.clock[0] += self.cost + (self.warmup if self.forwards == 0 else 0.0)
        self.forwards += 1
        y = self.linear(x)
        y.register_hook(self._count)
        return y

    def _count(self, grad: Tensor) -> None:
        self.backwards += 1


def test_time_cost_is_the_median_after_a_warm_up_of_forward_and_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_lab.pipeline.measuring import costs as measure

    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    model = nn.Sequential(Tick(clock, 1.0, warmup=50.0), Tick(clock, 3.0), Tick(clock, 0.5, warmup=9.0))
    assert measure.time_layers(model, torch.randn(2, 4), repeat=3) == [1.0, 3.0, 0.5]
    assert [m.forwards for m in model] == [4, 4, 4] and [m.backwards for m in model] == [4, 4, 4]
    assert balance_by_cost(layer_costs(model, "time", torch.randn(2, 4)), 2) == [1, 2]  # 1 | 3 + 0.5
    with pytest.raises(ValueError, match="repeat must be an integer >= 1, got 0"):
        measure.time_layers(model, torch.randn(2, 4), repeat=0)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_time_cost_profiles_in_training_mode_and_leaves_no_trace(mode: str) -> None:
    model = bn_model().train(mode == "train")
    model(torch.randn(6, 8)).sum().backward()
    sample = torch.randn(16, 8)
    recorder = model[6]
    recorder.forwards, recorder.backwards = [], 0
    before = snapshot(model)
    with torch.no_grad():
        costs = layer_costs(model, "time", sample)
    assert len(costs) == len(model) and all(c > 0 for c in costs)
    assert_same(before, model)
    assert recorder.forwards and all(training and grad for training, grad in recorder.forwards)
    assert recorder.backwards == len(recorder.forwards)


def test_time_cost_times_in_place_layers_as_their_model_runs_them() -> None:
    # each layer is timed alone on a leaf input that needs a gradient; an in-place layer writes
    # into it, as it writes into its input in the model (torchvision's ReLU(inplace=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                          nn.Hardswish(inplace=True), nn.Linear(8, 4))
    sample = torch.randn(16, 8)
    kept = sample.clone()
    before = snapshot(model)
    costs = layer_costs(model, "time", sample)
    assert len(costs) == len(model) and all(c > 0 for c in costs)
    assert_same(before, model)
    assert torch.equal(sample, kept)  # the in-place first layer wrote into a copy
    assert sum(balance_by_time(model, sample, 3)) == len(model)

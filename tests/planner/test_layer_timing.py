"""Per-layer timing as a stage runs its layers: the kinds, the replay hop, and the two-thread contended pass."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest

from gpipe_lab.planner import layer_timing
from gpipe_lab.planner.layer_timing import KINDS, layer_times
from gpipe_lab.planner.workload import WorkloadSpec


def tiny(dropout: float) -> WorkloadSpec:
    return WorkloadSpec("t", "transformer_tiny", {"seq_len": 6, "num_layers": 2, "d_model": 16, "ffn_dim": 32,
                                                  "num_heads": 2, "vocab_size": 32, "dropout": dropout}, 4)


@pytest.mark.parametrize("contended", [False, True])
def test_every_kind_is_timed_for_every_layer(contended: bool):
    work = tiny(0.0)
    times = layer_times(work, 2, repeat=1, contended=contended)
    assert set(times) == set(KINDS)
    assert all(len(v) == len(work.model()) and all(t > 0 for t in v) for v in times.values())


def test_a_replayed_forward_enters_the_replay_hop_only_where_the_forward_drew(monkeypatch):
    real = layer_timing.microbatch_context
    entries: list[int] = []

    @contextmanager
    def counting(generator):
        entries.append(1)
        with real(generator) as mode:
            yield mode

    monkeypatch.setattr(layer_timing, "microbatch_context", counting)
    counts = {}
    for dropout in (0.0, 0.1):
        entries.clear()
        layer_times(tiny(dropout), 2, repeat=1)
        counts[dropout] = len(entries)
    layers, passes = len(tiny(0.0).model()), 2  # one warm-up pass + one timed
    assert counts[0.0] == 2 * layers * passes  # forward without and with autograd; the replay skips it
    assert counts[0.1] > counts[0.0]  # the layers with dropout replay inside it


def test_the_contended_figures_are_the_mean_of_two_threads_run_in_step(monkeypatch):
    seen: list[tuple[str, object]] = []

    def fake(work, micro_batch, repeat, barrier):
        barrier.wait()  # both threads must be running at once to pass it
        seen.append((threading.current_thread().name, barrier))
        value = 1.0 if threading.current_thread().name.endswith("0") else 3.0
        return {k: [value, 2 * value] for k in KINDS}

    monkeypatch.setattr(layer_timing, "_timed_pass", fake)
    times = layer_times(tiny(0.0), 2, contended=True)
    assert times == {k: [2.0, 4.0] for k in KINDS}
    assert len({name for name, _ in seen}) == 2 and len({id(b) for _, b in seen}) == 1


def test_a_failing_timing_thread_is_raised_and_its_twin_does_not_hang(monkeypatch):
    def fake(work, micro_batch, repeat, barrier):
        if threading.current_thread().name.endswith("0"):
            raise ValueError("layer 3 broke")
        barrier.wait()  # released by the abort of the failing twin, not by the timeout
        return {}

    monkeypatch.setattr(layer_timing, "_timed_pass", fake)
    monkeypatch.setattr(layer_timing, "BARRIER_TIMEOUT_S", 60.0)
    with pytest.raises(RuntimeError, match="contended layer timing failed: layer 3 broke"):
        layer_times(tiny(0.0), 2, contended=True)


@pytest.mark.parametrize("repeat,micro_batch", [(0, 2), (1, 0)])
def test_bad_arguments_are_named(repeat: int, micro_batch: int):
    with pytest.raises(ValueError, match=f"repeat={repeat}, micro_batch={micro_batch}"):
        layer_times(tiny(0.0), micro_batch, repeat)

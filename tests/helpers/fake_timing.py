"""Planner profiles without timing: per-layer seconds made up from the layer count and the samples,
so planner tests run in milliseconds and never depend on the machine's load."""

from __future__ import annotations

import functools
import json

import pytest

from gpipe_lab.models import build
from gpipe_lab.planner import layer_timing

KINDS = layer_timing.KINDS


@functools.lru_cache(maxsize=32)
def _layers(preset: str, sizes: str) -> int:
    return len(build(preset, "meta", **json.loads(sizes)))


def fake_layer_times(work, micro_batch: int, repeat: int = 3, contended: bool = False) -> dict[str, list[float]]:
    """Fixed 50 us plus 20 us per sample per layer (backward twice the forward); 30% slower contended."""
    n = _layers(work.preset, json.dumps(work.sizes, sort_keys=True))
    slow = 1.3 if contended else 1.0
    forward = [slow * (5e-5 + 2e-5 * micro_batch * (1 + i % 3)) for i in range(n)]
    return {"forward_grad": forward, "forward_nograd": [0.8 * t for t in forward], "recompute": forward,
            "backward": [2 * t for t in forward]}


def use_fake_timing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[int]:
    """Patch the planner's timing (and cache folder, under ``tmp_path``); returns a list that grows
    by one per timed pass."""
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fake_layer_times(*args, **kwargs)

    monkeypatch.setattr(layer_timing, "layer_times", counted)
    monkeypatch.setattr(layer_timing, "engine_costs", lambda steps=3: (1e-4, 5e-5))
    monkeypatch.setattr(layer_timing, "split_backward", lambda work, steps=2: ((0.1, 1.0), (0.6, 0.5)))
    monkeypatch.setenv("GPIPE_LAB_CACHE", str(tmp_path / "cache"))
    return calls

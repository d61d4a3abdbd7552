"""A model's measured profile for the planner, measured once per (model, batch, sizes) and kept on disk.

The search's first step (``planner.search``). A ``Profile`` holds what the search needs to predict any plan without running it:

- per-layer seconds of each kind (``layer_timing.layer_times``: forward with and without autograd,
  replayed forward, backward; one thread) at every micro-batch size the search may use, alone and,
  for multi-stage plans, beside a second busy stage (``planner.contention``);
- the engine's own per-action overhead and hand-over per hop (``layer_timing.engine_costs``);
- what splitting the backward costs (``layer_timing.split_backward``: a first and a later stage's
  ``B`` and ``W`` under ``zb-h1`` as multiples of their full backward under ``gpipe``);
- per-layer parameters and per-sample saved / boundary bytes (``memory.layer_records``, counted on
  the meta device by the rule the engine's memory tracking uses), and each layer's saved bytes per
  call that do not grow with the samples (BatchNorm's per-channel statistics: ``fixed_bytes``, the
  intercept of the saved bytes counted on the CPU at 2 and 4 samples).

The cache key hashes the preset, its size overrides, the mini-batch, the micro-batch sizes, the
activation dtype and the torch version; the file is JSON under ``$GPIPE_LAB_CACHE/plans`` (default
``~/.cache/gpipe_lab/plans``). Delete it to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpipe_lab.models import example_input
from gpipe_lab.pipeline.measuring.costs import measure_layers, untouched
from gpipe_lab.planner import layer_timing
from gpipe_lab.planner.cost_model import CostModel
from gpipe_lab.planner.memory import LayerMemory, layer_records
from gpipe_lab.planner.workload import WorkloadSpec

__all__ = ["Profile", "cache_dir", "load_or_measure", "profile_key"]

#: Bumped when what a profile holds (or how it is measured) changes: older files are not read.
FORMAT = 2
Times = dict[int, dict[str, list[float]]]


@dataclass
class Profile:
    """One model's measured costs (see the module docstring); ``alone``/``contended`` map a micro-batch
    size to ``{kind: per-layer seconds}`` (``contended`` is None when only one stage was planned for)."""

    key: str
    preset: str
    sizes: dict[str, Any]
    batch: int
    alone: Times
    contended: Times | None
    overhead: float
    hop: float
    memory: list[LayerMemory]
    fixed_bytes: list[float]
    split_backward: tuple[tuple[float, float], ...]

    @property
    def num_layers(self) -> int:
        return len(self.memory)

    @property
    def micro_sizes(self) -> list[int]:
        """The micro-batch sizes measured: the model trains on these (plans use no other)."""
        return sorted(self.alone)

    def cost_model(self) -> CostModel:
        """The simulator's per-layer cost model fitted from the timings.

        Raises:
            ValueError: fewer than two micro-batch sizes were measured (from ``CostModel.fit``).
        """
        return CostModel.fit(self.alone, self.overhead, self.hop, self.contended)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["memory"] = [{**asdict(m), "saved_inputs": sorted(m.saved_inputs),
                           "saved_outputs": sorted(m.saved_outputs)} for m in self.memory]
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """Raises: KeyError / TypeError: a file not written by ``to_json`` of this ``FORMAT``."""
        def times(table: dict[str, Any] | None) -> Times | None:
            return None if table is None else {int(s): v for s, v in table.items()}

        memory = [LayerMemory(m["params"], tuple(m["inputs"]), tuple(m["outputs"]), tuple(m["passthrough"]),
                              frozenset(m["saved_inputs"]), frozenset(m["saved_outputs"]), m["saved_other"])
                  for m in data["memory"]]
        return cls(data["key"], data["preset"], data["sizes"], int(data["batch"]), times(data["alone"]) or {},
                   times(data["contended"]), float(data["overhead"]), float(data["hop"]), memory,
                   [float(b) for b in data["fixed_bytes"]],
                   tuple((float(b), float(w)) for b, w in data["split_backward"]))


def cache_dir() -> Path:
    """``$GPIPE_LAB_CACHE/plans``, else ``~/.cache/gpipe_lab/plans``."""
    root = os.environ.get("GPIPE_LAB_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "gpipe_lab") / "plans"


def profile_key(preset: str, sizes: dict[str, Any], batch: int, micro_sizes: list[int], contended: bool,
                repeat: int) -> str:
    """The cache key: a hash of everything the measured figures depend on."""
    what = {"format": FORMAT, "preset": preset, "sizes": sizes, "batch": batch, "micro": sorted(micro_sizes),
            "contended": contended, "repeat": repeat, "dtype": "float32", "torch": torch.__version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:24]


def measure(preset: str, sizes: dict[str, Any], batch: int, micro_sizes: list[int], contended: bool,
            repeat: int, key: str) -> Profile:
    """Time and count the model now (see the module docstring).

    Raises:
        ValueError: fewer than two micro-batch sizes, or an invalid preset / sizes (``models.build``).
    """
    if len(set(micro_sizes)) < 2:
        raise ValueError(f"a profile needs >= 2 micro-batch sizes (fixed + per-sample costs), got {micro_sizes}")
    work = WorkloadSpec(preset, preset, dict(sizes), batch)
    alone: Times = {}
    for s in sorted(set(micro_sizes)):
        try:
            alone[s] = layer_timing.layer_times(work, s, repeat)
        except (RuntimeError, ValueError):
            continue  # the model cannot train on s samples (BatchNorm over one value): no plan uses s
    if len(alone) < 2:
        raise ValueError(f"{preset} trains on fewer than two of the micro-batch sizes {sorted(set(micro_sizes))} "
                         f"(measured: {sorted(alone)}); use a larger batch")
    beside = {s: layer_timing.layer_times(work, s, repeat, contended=True) for s in alone} if contended else None
    overhead, hop = layer_timing.engine_costs()
    memory = list(layer_records(preset, **sizes))
    return Profile(key, preset, dict(sizes), batch, alone, beside, overhead, hop, memory, fixed_bytes(work),
                   layer_timing.split_backward(work))


def fixed_bytes(work: WorkloadSpec) -> list[float]:
    """Per layer, the saved bytes of one call that do not grow with its samples (2 x at 2 samples minus
    at 4 samples, never negative)."""
    model = work.model()
    with untouched(model, train=True):
        two, four = (measure_layers(model, example_input(model, n, "cpu"), "activation_bytes") for n in (2, 4))
    return [max(0.0, 2 * a - b) for a, b in zip(two, four)]


def load_or_measure(preset: str, sizes: dict[str, Any], batch: int, micro_sizes: list[int],
                    contended: bool = True, repeat: int = 3, directory: Path | None = None,
                    ) -> tuple[Profile, bool]:
    """The cached profile of this model and batch, else a new measurement (then saved); returns it and
    whether it came from the cache.

    Raises:
        ValueError: as ``measure``.
        OSError: the cache directory cannot be written.
    """
    key = profile_key(preset, sizes, batch, micro_sizes, contended, repeat)
    path = (directory or cache_dir()) / f"{preset}-{key}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("format") == FORMAT:
                return Profile.from_json(data), True
        except (ValueError, KeyError, TypeError):
            pass  # a torn or foreign file: measured again and overwritten below
    profile = measure(preset, sizes, batch, micro_sizes, contended, repeat, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json()))
    tmp.replace(path)  # a reader never sees half a file
    return profile, False

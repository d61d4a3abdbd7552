"""The throughput tables' simulator: per-layer times fitted into a cost model, its errors, the tables' settings.

The steps themselves are timed by ``gpipe_lab.bench.step_timing.measure_step``.
``timed_cost_model`` fits the planner's ``CostModel`` (fixed + per-sample per layer, alone
and beside a second busy stage, from ``layer_timing.layer_times``; engine overhead
per action; hand-over per hop); ``throughput_grid`` predicts every cell of a grid with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpipe_lab.bench import EmulatedSpec
from gpipe_lab.planner.cost_model import CostModel, LinearCost
from gpipe_lab.planner.layer_timing import engine_overhead, hop_seconds, layer_times  # noqa: F401 - the experiments' one import
from gpipe_lab.planner.workload import WorkloadSpec

#: How the simulated cells are made, for the tables' descriptions (one text for every table).
SIMULATOR_TEXT = (
    "*Simulated*: the planner's simulator with a cost model fitted once per workload: every layer's "
    "forward (inside the random-replay hop, as a stage runs it), replayed forward and backward timed at "
    "each micro-batch size, one thread, fitted as fixed + per-sample between neighbouring sizes; timed once "
    "alone and once beside a second thread running the same pass, and each action of a multi-stage step "
    "costs between the two by the share of it another stage computes (`planner/contention.py`); plus "
    "the engine's per-action overhead and the measured hand-over.")


def proportional(times: dict[str, list[float]], samples: int) -> dict[int, dict[str, list[float]]]:
    """One size's per-layer times as two points of a cost with no fixed part (for a single-M grid)."""
    return {samples: times, 2 * samples: {k: [2 * t for t in v] for k, v in times.items()}}



def cost_model_of(times_by_size: dict[int, dict[str, list[float]]], overhead: float, hop: float,
                  contended_by_size: dict[int, dict[str, list[float]]] | None = None) -> CostModel:
    """The simulator's cost model from per-layer times at each micro-batch size, alone and (optionally)
    contended (one size: proportional)."""
    def two_sizes(by_size: dict[int, dict[str, list[float]]]) -> dict[int, dict[str, list[float]]]:
        if len(by_size) == 1:
            (samples, times), = by_size.items()
            return proportional(times, samples)
        return by_size

    return CostModel.fit(two_sizes(times_by_size), overhead, hop,
                         None if contended_by_size is None else two_sizes(contended_by_size))


def timed_cost_model(work: WorkloadSpec, sizes: list[int], repeat: int, overhead: float, hop: float,
                     contended: bool = True) -> CostModel:
    """Time ``work``'s layers at each micro-batch size (alone, and beside a second stage when
    ``contended``) and fit the simulator's cost model from them."""
    alone = {s: layer_times(work, s, repeat) for s in sizes}
    beside = {s: layer_times(work, s, repeat, contended=True) for s in sizes} if contended else None
    return cost_model_of(alone, overhead, hop, beside)


def emulated_cost_model(emu: EmulatedSpec) -> CostModel:
    """The emulated devices' exact costs (what their layers sleep), no engine overhead, no hand-over."""
    seconds = emu.per_sample_seconds()
    forward = [LinearCost(0.0, s) for s in seconds]
    return CostModel({"forward_grad": forward, "forward_nograd": forward,
                      "backward": [LinearCost(0.0, emu.backward_ratio * s) for s in seconds]})



def error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, or None when either is missing."""
    return None if predicted is None or not measured else (predicted - measured) / measured


def uncontended(cost: CostModel) -> CostModel:
    """``cost`` with stages that never slow each other (its alone times only)."""
    return dataclasses.replace(cost, contended=None)


def simulator_findings(rows: list[dict], error_key: str = "sim_error", alone_key: str | None = "sim_alone_error",
                       label: str = "measured cells") -> str:
    """Sentences computed from ``rows``: in how many the simulator is within 10% of the measured step,
    per K, with and (``alone_key``) without the contention term."""
    lines = []
    for multi in (False, True):
        cells = [r for r in rows if r.get(error_key) is not None and (r["K"] > 1) == multi]
        if not cells:
            continue
        within = sum(abs(r[error_key]) <= 0.10 for r in cells)
        worst = max(cells, key=lambda r: abs(r[error_key]))
        line = (f"- Simulator within 10% of the {label} at {'K >= 2' if multi else 'K = 1'} in {within} of "
                f"{len(cells)} (largest error {worst[error_key]:+.1%}, {worst['workload']} K={worst['K']} "
                f"M={worst['M']})")
        plain = [r[alone_key] for r in cells if alone_key and r.get(alone_key) is not None]
        if multi and plain and len(plain) == len(cells):
            line += (f"; without the contention term, within 10% in {sum(abs(e) <= 0.10 for e in plain)} of "
                     f"{len(cells)} (largest error {max(plain, key=abs):+.1%})")
        lines.append(line + ".")
    return "\n".join(lines)


def emulation_settings(e: Any) -> tuple[list[int], float]:
    """``experiment.emulated_k`` (default K = 1, 2, 4, 8) and ``experiment.emulated_forward_ms`` (default
    1600: the emulated mini-batch forward; at K=8, M=32 an action then sleeps 6 ms or more) of a config."""
    from omegaconf import OmegaConf

    ks = OmegaConf.select(e, "emulated_k", default=None)
    ms = OmegaConf.select(e, "emulated_forward_ms", default=None)
    return [1, 2, 4, 8] if ks is None else [int(k) for k in ks], 1600.0 if ms is None else float(ms)


def tiny_overrides(amoebanet_config: str, transformer_config: str) -> dict[str, list[str]]:
    """``--tiny`` overrides of a throughput table's two configs: toy networks, one timed step."""
    common = ["experiment.steps=1", "experiment.repeat=1", "++experiment.emulated_k=[1,2]",
              "++experiment.emulated_forward_ms=8"]
    return {amoebanet_config: ["model.num_layers=3", "model.num_filters=8",
                             "data.batch_size=64", "data.num_train=640", *common],
            transformer_config: [
                "model.d_model=32", "model.ffn_dim=64", "model.num_heads=2", "data.batch_size=32", "data.num_train=640",
                "experiment.workload.sizes.num_layers=8", "experiment.workload.sizes.vocab_size=64",
                "experiment.workload.sizes.seq_len=8", *common]}

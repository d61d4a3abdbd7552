"""The sentences the throughput tables print about the simulator are computed from their rows."""

from __future__ import annotations

from experiments.table2_throughput import disagreements
from experiments.throughput_lib import simulator_findings


def row(K: int, M: int, measured: float | None, simulated: float, alone: float, err: float | None = None,
        alone_err: float | None = None) -> dict:
    return {"workload": "w", "K": K, "M": M, "measured_s": measured, "simulated_s": simulated,
            "simulated_alone_s": alone, "sim_error": err, "sim_alone_error": alone_err,
            "emulated_s": 1.1, "emulated_sim_s": 1.0, "emulated_error": -0.09}


def test_disagreements_split_the_gap_into_engine_contention_and_costs():
    grid = [row(2, 4, None, 2.0, 1.5)]
    emu, sim = {("w", 2, 4): 1.30}, {("w", 2, 4): 0.65}
    (line,) = disagreements(grid, emu, sim)
    assert "emulated 1.30 vs simulated 0.65 (-50%)" in line
    assert "the engine adds +10% to the emulated step" in line
    assert "contention between CPU stage threads adds +33% to the simulated step" in line
    assert disagreements(grid, emu, {("w", 2, 4): 1.32}) == []  # within 5%: nothing to explain


def test_findings_count_cells_within_ten_percent_per_k_with_and_without_contention():
    rows = [row(1, 4, 1.0, 1.0, 1.0, -0.12), row(2, 4, 1.0, 1.0, 1.0, -0.05, -0.30),
            row(2, 32, 1.0, 1.0, 1.0, 0.08, -0.50)]
    text = simulator_findings(rows)
    assert "at K = 1 in 0 of 1 (largest error -12.0%, w K=1 M=4)" in text
    assert "at K >= 2 in 2 of 2 (largest error +8.0%, w K=2 M=32)" in text
    assert "without the contention term, within 10% in 0 of 2 (largest error -50.0%)" in text
    emulated = simulator_findings(rows, "emulated_error", None, "emulated cells")
    assert "emulated cells at K >= 2 in 2 of 2" in emulated and "contention" not in emulated

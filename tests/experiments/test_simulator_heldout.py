"""The held-out simulator check: a tiny run freezes one cost model (hand-over from its calibration step,
never a judged cell) and counts in-sample and held-out cells apart; the counts can fail."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from experiments import simulator_heldout as heldout


def test_counts_keep_in_sample_and_held_out_apart() -> None:
    rows = [{"cell": "in-sample", "width": 8, "K": 2, "M": 1, "error": 0.05},
            {"cell": "held-out M", "width": 8, "K": 2, "M": 8, "error": -0.30},
            {"cell": "held-out width", "width": 4, "K": 2, "M": 8, "error": 0.02},
            {"cell": "held-out K", "width": 8, "K": 4, "M": 8, "error": None}]
    assert heldout.counts(rows, False) == "- in-sample: within 10% in 1 of 1 (largest error +5.0%, in-sample d=8 K=2 M=1)."
    assert heldout.counts(rows, True) == ("- held-out: within 10% in 1 of 2 (largest error -30.0%, held-out M d=8 "
                                          "K=2 M=8).")


def test_tiny_run_freezes_the_hand_over_of_its_calibration_step(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[tuple[int, int]] = []
    real = heldout.measure_step

    def measure(work: object, k: int, m: int, steps: int) -> tuple:
        measured.append((k, m))
        return real(work, k, m, steps)

    monkeypatch.setattr(heldout, "measure_step", measure)
    monkeypatch.setattr(heldout, "hop_seconds", lambda timeline: 0.125)
    monkeypatch.setattr(sys, "argv", ["simulator_heldout.py", "--tiny", "--out", str(tmp_path)])
    heldout.main()
    data = json.loads((tmp_path / "simulator_heldout.json").read_text())
    assert data["meta"]["commit"] and data["calibration"]["handover_s"] == 0.125
    assert measured[0] == (2, heldout.TINY["calibration_m"]) and measured.count(measured[0]) == 1
    judged = [(r["K"], r["M"]) for r in data["rows"] if r["measured_s"] is not None]
    assert (2, heldout.TINY["calibration_m"]) not in judged
    assert {r["cell"] for r in data["rows"]} == {"in-sample", "held-out M", "held-out width", "held-out K"}
    # a 0.125 s hop on each of the K=2 step's hops puts every K=2 prediction far above its tiny measured step
    assert all(r["error"] > 1.0 for r in data["rows"] if r["error"] is not None)
    text = (tmp_path / "simulator_heldout.md").read_text()
    assert "- in-sample: within 10% in 0 of 2" in text and "- held-out: within 10% in 0 of 2" in text

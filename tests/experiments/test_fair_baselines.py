"""Fair baselines in the sweeps' Table 2: repeated jobs of a cell are averaged with their range, the
unpipelined job's threads are stated, and the ratio is also given in the table's own normalization;
every job's commit is shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_experiment_configs import fake_job, run_main

from experiments import table2_throughput


def test_repeats_are_averaged_and_the_k1_comparison_names_threads_and_spread(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    sweep, num = tmp_path / "sweep", 0
    cells = {(1, 1, 2): [90.0, 100.0, 110.0], (2, 1, 1): [120.0, 120.0, 120.0], (2, 4, 1): [150.0, 160.0, 170.0]}
    for (k, m, threads), values in cells.items():
        for seed, sps in enumerate(values):
            fake_job(sweep, num, "paper_table2_transformer", [], K=k, M=m, samples_per_s=sps, seed=seed,
                     threads_per_stage=threads, commit="abc123def456")
            num += 1
    run_main(table2_throughput, monkeypatch, "--from-multirun", str(sweep), "--out", str(tmp_path / "o"))
    text = (tmp_path / "o" / "table2_throughput.md").read_text()
    assert "| Transformer-48 analogue | 1 | 0.83 [0.75, 0.92] (n=3) | 1.00 [1.00, 1.00] (n=3) |" in text
    assert "| Transformer-48 analogue | 4 | - | 1.33 [1.25, 1.42] (n=3) |" in text
    assert ("K=2 at its fastest M (M=4, 160.00 [150.00, 170.00] (n=3) samples/s, 2 threads in all) is 1.60x the "
            "unpipelined job (K=1, M=1, 100.00 [90.00, 110.00] (n=3) samples/s, 2 threads); in the table's "
            "normalization (K=2, M=1 = 1.00) K=1, M=1 is 0.83 and K=2, M=4 is 1.33.") in text
    assert text.count("`abc123def456`") == 9


def test_unequal_threads_and_single_runs_are_called_out(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = tmp_path / "sweep"
    fake_job(sweep, 0, "paper_table2_transformer", [], K=1, M=1, samples_per_s=100.0, threads_per_stage=1)
    fake_job(sweep, 1, "paper_table2_transformer", [], K=2, M=1, samples_per_s=150.0, threads_per_stage=1)
    run_main(table2_throughput, monkeypatch, "--from-multirun", str(sweep), "--out", str(tmp_path / "o"))
    text = (tmp_path / "o" / "table2_throughput.md").read_text()
    assert "the ratio mixes pipelining with threads" in text and "fewer than 3 repeats (1 and 1)" in text
    assert "not recorded" in text

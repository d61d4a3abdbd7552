"""The micro-batch cost collector: K=1 one-thread jobs give the most Table 2's K=2 can gain at each M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_experiment_configs import fake_job

from experiments import microbatch_cost


def test_the_bound_is_per_sample_speed_times_fill_drain(tmp_path: Path) -> None:
    sweep, num = tmp_path / "sweep", 0
    speeds = {("never", 1): [600.0, 610.0], ("never", 4): [430.0], ("except_last", 1): [600.0],
              ("except_last", 4): [300.0]}
    for (mode, m), values in speeds.items():
        for sps in values:
            fake_job(sweep, num, "paper_table2_amoebanet", [f"pipeline.checkpoint={mode}"], K=1, M=m,
                     samples_per_s=sps, threads_per_stage=1)
            num += 1
    fake_job(sweep, num, "paper_table2_amoebanet", [], K=1, M=4, samples_per_s=999.0, threads_per_stage=2)  # not one thread
    fake_job(sweep, num + 1, "paper_table2_amoebanet", [], K=2, M=4, samples_per_s=999.0, threads_per_stage=1)
    assert microbatch_cost.main(["--from-multirun", str(sweep), "--out", str(tmp_path / "o")]) == 0
    text = (tmp_path / "o" / "microbatch_cost.md").read_text()
    # never: 430 / 605 = 0.71 per sample, x 2*4/5 = 1.14; except_last: 300 / 600 = 0.50, x 1.6 = 0.80
    assert "| AmoebaNet-D(18, 256) analogue | never | 4 | 430.0 | 1 | 0.71 | 1.14 |" in text
    assert "| AmoebaNet-D(18, 256) analogue | never | 1 | 605.0 | 2 | 1.00 | 1.00 |" in text
    assert ("checkpoint=except_last: K=2 can reach at most M=4: 0.80 of its K=2, M=1 throughput here: below K=2, "
            "M=1 at M=4 even before contention and hand-overs.") in text
    assert "checkpoint=never: K=2 can reach at most M=4: 1.14 of its K=2, M=1 throughput here: not below" in text
    data = json.loads((tmp_path / "o" / "microbatch_cost.json").read_text())
    assert data["meta"]["commit"] and len(data["rows"]) == 4


def test_a_folder_without_one_thread_k1_jobs_is_refused(tmp_path: Path) -> None:
    fake_job(tmp_path / "sweep", 0, "paper_table2_transformer", [], K=2, M=4, threads_per_stage=1)
    with pytest.raises(ValueError, match="no K=1 job on one intra-op thread"):
        microbatch_cost.main(["--from-multirun", str(tmp_path / "sweep"), "--out", str(tmp_path / "o")])

"""benchmarks/gpu_check.py --dry-run: every section wired on the CPU, PASS each, both reports written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmarks import gpu_check


def test_dry_run_wires_every_section(tmp_path: Path) -> None:
    """Run as the README says, a file (from another directory): it reruns itself as the module."""
    script = Path(gpu_check.__file__)
    done = subprocess.run([sys.executable, str(script), "--dry-run", "--two-gpus", "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [s[0] for s in gpu_check.SECTIONS] + [gpu_check.TWO_GPUS[0]]
    assert list(report["sections"]) == names
    assert {r["status"] for r in report["sections"].values()} == {"PASS"}, report
    assert report["dry_run"] is True and report["sections"]["correctness"]["runs"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}: PASS" in md for name in names)
    assert "CPU figures, not GPU ones" in md


def test_a_failing_section_is_reported_and_the_rest_still_run(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: object) -> dict:
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_check, "SECTIONS", [("broken", broken, 5), *gpu_check.SECTIONS[1:2]])
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["broken"]["status"] == "FAIL" and "boom" in sections["broken"]["error"]
    assert sections["host_syncs"]["status"] == "PASS"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_a_real_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path)])

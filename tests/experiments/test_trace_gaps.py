"""benchmarks/trace_gaps.py: device gaps of a Chrome trace, on a trace built here (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import trace_gaps


def kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


TRACE = {"traceEvents": [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
    kernel("gemm", 100, 400),
    kernel("overlapping", 300, 100, stream=9),  # inside gemm's span: no gap after it
    kernel("sdpa_fwd", 2500, 300),  # 2 ms after gemm ended
    kernel("tail", 2850, 50),  # 0.05 ms later: below the threshold
]}


def test_gaps_are_measured_from_the_last_busy_moment_across_streams() -> None:
    events = trace_gaps.device_events(TRACE)
    assert [e["name"] for e in events] == ["gemm", "overlapping", "sdpa_fwd", "tail"]
    assert trace_gaps.gaps(events, 500) == [(400, 2000, "gemm", "sdpa_fwd")]


def test_the_report_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    assert trace_gaps.main([str(path), "--min-gap-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"python -m benchmarks.trace_gaps {path} --min-gap-ms 1.0")
    assert "span 2.80 ms, busy (summed over streams) 0.85 ms" in out
    assert "idle stretches of at least 1.0 ms: 1, 2.00 ms in all" in out
    assert "before: gemm; after: sdpa_fwd" in out


def test_a_trace_without_device_events_is_refused() -> None:
    with pytest.raises(ValueError, match="no device events"):
        trace_gaps.device_events({"traceEvents": [TRACE["traceEvents"][0]]})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("name", ["gpu_step_costs", "gpu_diagnose_threads"])
def test_the_gpu_probes_say_they_need_cuda(name: str, tmp_path: Path) -> None:
    module = __import__(f"benchmarks.{name}", fromlist=["main"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        module.main(*([[str(tmp_path)]] if name == "gpu_diagnose_threads" else []))


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gzip

    plain, packed = tmp_path / "trace.json", tmp_path / "trace.json.gz"
    plain.write_text(json.dumps(TRACE))
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        json.dump(TRACE, f)
    reports = []
    for path in (plain, packed):
        assert trace_gaps.main([str(path), "--min-gap-ms", "1"]) == 0
        reports.append(capsys.readouterr().out.split("\n", 1)[1])  # below the command line, which names the file
    assert reports[0] == reports[1] and "idle stretches of at least 1.0 ms: 1" in reports[1]


def test_the_thread_diagnosis_writes_its_traces_outside_the_repository_unless_told() -> None:
    from benchmarks.gpu_diagnose_threads import trace_folder

    root = Path(__file__).resolve().parents[2]
    default = trace_folder([])
    assert not default.resolve().is_relative_to(root) and default.name and not default.exists()
    assert trace_folder(["somewhere"]) == Path("somewhere")
    with pytest.raises(SystemExit, match=r"usage: .*gpu_diagnose_threads \[OUT_DIR\]"):
        trace_folder(["a", "b"])

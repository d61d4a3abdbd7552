"""benchmarks/gpu_check.py --dry-run: every section wired on the CPU, each in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from benchmarks import gpu_check
from benchmarks.gpu_check_engine import Context, record_case
from benchmarks.gpu_check_probes import order_violations

from gpipe_lab.bench.provenance import source_commit
from gpipe_lab.pipeline.measuring.step_timeline import Event


def test_dry_run_wires_every_section(tmp_path: Path) -> None:
    """Run as the README says, a file (from another directory): it reruns itself as the module."""
    script = Path(gpu_check.__file__)
    done = subprocess.run([sys.executable, str(script), "--dry-run", "--two-gpus", "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [s[0] for s in gpu_check.SECTIONS] + [gpu_check.TWO_GPUS[0]]
    assert {"backward_probe", "race", "launch_bound", "copy_overlap", "leak", "amp_fp16",
            "distributed_links"} <= set(names)
    assert list(report["sections"]) == names
    assert {r["status"] for r in report["sections"].values()} == {"PASS"}, report
    sections = report["sections"]
    assert report["dry_run"] is True and sections["correctness"]["runs"] > 0
    progress = [json.loads(line) for line in (tmp_path / "gpu_check_progress.jsonl").read_text().splitlines()]
    finished = [p for p in progress if p["section"] == "correctness" and p.get("state") != "started"]
    assert len(finished) == sections["correctness"]["runs"] + len(sections["correctness"]["replay_modes"]["kinds"])
    # several steps of a K=1 and a virtual_stages=2 pipe: guard and dispatch ran (fork needs a GPU)
    kinds = sections["correctness"]["replay_modes"]["kinds"]
    assert {"guard", "dispatch"} <= set().union(*map(set, kinds.values())) and "K=1" in kinds
    # the two-GPU paths compare gradients with the unpipelined model (here on CPU sizes)
    assert sections["two_gpus"]["grad_relative_error_vs_unpipelined"] <= 1e-5
    assert sections["race"]["amplifying_sleeps"] > 0 and sections["copy_overlap"]["hand_overs"] > 0
    assert sections["amp_fp16"]["inf_step_skipped"] and sections["amp_fp16"]["scale_backed_off"]
    assert len(sections["launch_bound"]["configs"]) == 4 and len(sections["leak"]["readings"]) == 3
    speed = sections["speed"]  # paired ratios from alternating rounds, with their spread
    assert speed["rounds"] == 2 and "paired ratios" in speed["timing"] and speed["device_warm_up_seconds"] == 0
    for row in speed["configs"].values():
        low, high = row["vs_accumulation_range"]
        assert low <= row["vs_accumulation"] <= high
    # torchrun itself (``python -m torch.distributed.run``) starts the README's 2-rank demo here; test_docs
    # forks the ranks of the README's torchrun commands instead
    assert sections["two_gpus"]["demo"]["returncode"] == 0, sections["two_gpus"]["demo"]
    links = sections["distributed_links"]
    assert links["clipping"]["norm_relative_error"] <= 1e-5 and len(links["ranks"]) == 2
    for rank in links["ranks"]:  # receive streams made once over 5 steps; warm-up first, in order
        assert rank["grad_relative_error_vs_unpipelined"] <= 1e-5
        assert rank["receive_streams_made"] == rank["incoming_links"] == 1
        assert rank["warm_up_in_global_order"] and rank["warm_up_before_first_send"]
    assert links["ranks"][0]["sent_alive_at_last_backward"] == [0] * 5
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}: PASS" in md for name in names)
    assert "CPU figures, not GPU ones" in md
    assert f"report: {tmp_path / 'gpu_check.md'}" in done.stdout and "commit it with: git add" in done.stdout
    meta = report["meta"]  # provenance, as every JSON of results/ carries it
    assert meta["commit"].split("+")[0] == source_commit().split("+")[0] and meta["commit"] in md
    assert meta["torch"] == torch.__version__ and "--dry-run --two-gpus" in meta["command"]
    assert meta["cpu"] and meta["cores"] == os.cpu_count() and f"{meta['cpu']}, {meta['cores']} CPU cores" in md
    assert len(meta["load_average"]) == len(meta["load_average_after"]) == 3 and meta["date"] in md


# Sections for the runner's own test, run in the check's child processes (importable by this module's name).
def raises(ctx: Context) -> dict:
    raise RuntimeError("boom")


def hangs(ctx: Context) -> dict:
    record_case(ctx, "hangs", "first", relative_error=0.0)
    record_case(ctx, "hangs", "second", state="started")
    threading.Event().wait()  # never set: only the runner's kill ends this
    return {"status": "PASS"}


def dies(ctx: Context) -> dict:
    os._exit(3)


def reads_the_report(ctx: Context) -> dict:
    assert ctx.out is not None
    done = json.loads((ctx.out / "gpu_check.json").read_text())["sections"]
    return {"status": "PASS", "already_written": {name: r["status"] for name, r in done.items()}}


def test_a_failing_hanging_or_dying_section_loses_only_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    here = __name__
    monkeypatch.setattr(gpu_check, "SECTIONS", [("raises", f"{here}:raises", 30),
                                                ("hangs", f"{here}:hangs", 3),
                                                ("dies", f"{here}:dies", 30),
                                                ("reads", f"{here}:reads_the_report", 30)])
    # what this module imports, without Lightning: each child then imports only this module
    monkeypatch.setattr(gpu_check, "PRELOAD", ["benchmarks.gpu_check_probes"])
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["raises"]["status"] == "FAIL" and "boom" in sections["raises"]["error"]
    assert sections["hangs"]["status"] == "FAIL" and "over its cap of 3 s" in sections["hangs"]["error"]
    # the cases it wrote as they went: one finished, and the one it hung in
    assert sections["hangs"]["cases_finished"] == 1 and sections["hangs"]["unfinished_case"] == "second"
    assert sections["dies"]["status"] == "FAIL" and "exit code 3" in sections["dies"]["error"]
    # the report was on disk, with every earlier section, before the last section ran
    assert sections["reads"]["already_written"] == {"raises": "FAIL", "hangs": "FAIL", "dies": "FAIL"}
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2] == f"report: {tmp_path / 'gpu_check.md'} and {tmp_path / 'gpu_check.json'} " \
                          f"(cases as they finished: {tmp_path / 'gpu_check_progress.jsonl'})"
    assert printed[-1].startswith(f"commit it with: git add {tmp_path / 'gpu_check.md'} {tmp_path / 'gpu_check.json'}"
                                  " && git commit -m 'results: gpu_check on dry run")


def test_hand_offs_out_of_order_are_named() -> None:
    ok = [Event(0, "F", 0, 0.0, 1.0), Event(1, "F", 0, 1.0, 2.0), Event(1, "B", 0, 2.0, 3.0),
          Event(0, "B", 0, 3.0, 4.0)]
    assert order_violations(ok) == []
    early = [Event(0, "F", 0, 0.0, 1.0), Event(1, "F", 0, 0.5, 2.0), Event(1, "B", 0, 2.0, 3.0),
             Event(0, "B", 0, 2.5, 4.0)]
    assert [v.split(" started")[0] for v in order_violations(early)] == ["F(1,0)", "B(0,0)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_a_real_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path)])


def test_the_one_gpu_sections_fit_in_eight_minutes_with_start_up() -> None:
    # 20 s left for the section server's imports
    assert sum(cap for _, _, cap in gpu_check.SECTIONS) <= 8 * 60 - 20
    # a section's cap leaves room for its own timeouts to fire and be reported
    from benchmarks.gpu_check_links import LAUNCH_TIMEOUT

    caps = {name: cap for name, _, cap in gpu_check.SECTIONS}
    assert caps["distributed_links"] >= LAUNCH_TIMEOUT + 10


def test_the_replay_check_fails_when_draws_are_not_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    from benchmarks import gpu_check_engine

    from gpipe_lab.pipeline import GPipe

    monkeypatch.setattr(gpu_check_engine, "GPipe", functools.partial(GPipe, random_replay=False))
    failures = gpu_check_engine.replay_modes(Context(torch.device("cpu"), dry=True))["failures"]
    assert "replay K=1: dropout differs between checkpoint='always' and 'never'" in failures
    assert "replay modes ['dispatch', 'guard'] never ran (ran: ['off'])" in failures

"""The workloads and the timer the benchmarks and experiments share (``gpipe_lab.bench``, ``planner.workload``,
``pipeline.measuring.call_timing``).

No duration is asserted: only what the timer calls, in which order, and what it keeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpipe_lab.bench import mlp
from gpipe_lab.pipeline.measuring.call_timing import Timing, paired_ratio, time_call, time_rounds
from gpipe_lab.planner.workload import WorkloadSpec, tiny_linear


def test_rounds_alternate_their_order_and_drop_the_warmup():
    calls: list[str] = []
    between: list[int] = []
    timings = time_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1,
                          between=lambda: between.append(len(calls)))
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert between == list(range(8))  # before every call
    assert {name: len(t.times) for name, t in timings.items()} == {"a": 3, "b": 3}


def test_timing_summary_is_read_from_its_times():
    timing = Timing((3.0, 1.0, 2.0, 10.0))
    assert timing.summary() == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}


@pytest.mark.parametrize(("repeats", "warmup"), [(0, 0), (1, -1)])
def test_bad_repeats_or_warmup_are_named(repeats, warmup):
    with pytest.raises(ValueError, match=f"repeats={repeats}, warmup={warmup}"):
        time_call(lambda: None, repeats, warmup)
    with pytest.raises(ValueError, match="at least one function"):
        time_rounds({}, 1)


def test_paired_ratio_is_the_median_of_the_per_round_ratios():
    a, b = Timing((1.5, 6.0, 3.0)), Timing((1.0, 4.0, 2.0))  # the machine slowed down in rounds 2 and 3
    assert paired_ratio(a, b) == pytest.approx(1.5)
    # per-round ratios 1.5, 0.375, 4.5: their median 1.5, where the ratio of medians says 0.75
    c = Timing((1.5, 1.5, 9.0))
    assert paired_ratio(c, b) == pytest.approx(1.5) and c.median / b.median == pytest.approx(0.75)
    with pytest.raises(ValueError, match="same rounds of both, got 3 and 2 calls"):
        paired_ratio(a, Timing((1.0, 2.0)))


def test_mlp_splits_whole_blocks_and_is_seeded():
    work = mlp(16, 8, 32, blocks=8, partitions=3)
    assert work.balance == [9, 9, 6] and sum(work.balance) == len(work.module)
    again = mlp(16, 8, 32, blocks=8, partitions=3)
    assert torch.equal(work.inputs, again.inputs)
    assert all(torch.equal(p, q) for p, q in zip(work.module.parameters(), again.module.parameters()))
    assert work.loss_fn(work.module(work.inputs), work.targets).item() > 0
    with pytest.raises(ValueError, match="partitions must be in 1..8"):
        mlp(16, 8, 32, blocks=8, partitions=9)
    assert tiny_linear(8, partitions=2).balance == [2, 2]


def test_preset_specs_build_the_same_workload_twice_with_a_flops_balance():
    spec = WorkloadSpec("t", "transformer_tiny", {"seq_len": 6, "num_layers": 1, "d_model": 16, "ffn_dim": 32,
                                                  "num_heads": 2, "vocab_size": 32}, 3)
    one, two = spec.build(2), spec.build(2)
    assert one.name == "t" and one.batch == 3 and len(one.balance) == 2
    assert sum(one.balance) == len(one.module) and one.balance == two.balance
    src, tgt_in = one.inputs
    assert torch.equal(src, two.inputs[0]) and torch.equal(one.targets, src.roll(-1, dims=1))
    assert one.loss_fn(one.module(one.inputs), one.targets).item() > 0
    images = WorkloadSpec("a", "amoebanet_d_tiny", {"num_layers": 3, "num_filters": 8, "image_size": 16}, 4).build()
    assert images.balance == [len(images.module)] and images.targets.dtype == torch.int64
    assert images.loss_fn(images.module(images.inputs), images.targets).item() > 0


def test_a_script_started_as_a_file_reruns_as_its_module_from_any_folder(tmp_path):
    import subprocess
    import sys

    package = tmp_path / "repo" / "scripts_pkg" / "inner"
    package.mkdir(parents=True)
    for folder in (package, package.parent):
        (folder / "__init__.py").write_text("")
    (package / "job.py").write_text(
        "if not __package__:\n    from gpipe_lab.bench.script_launch import rerun_as_module\n\n"
        "    rerun_as_module(__file__)\nimport sys\nfrom scripts_pkg import inner\n"
        "print(__spec__.name, inner.__name__, sys.argv[1:])\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, str(package / "job.py"), "a=1", "--x"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "scripts_pkg.inner.job scripts_pkg.inner ['a=1', '--x']"


def test_launch_refuses_a_file_outside_a_package(tmp_path):
    from gpipe_lab.bench.script_launch import module_of

    with pytest.raises(ValueError, match="not inside a package"):
        module_of(tmp_path / "alone.py")


def test_markdown_table_formats_cells_and_names_a_ragged_row():
    from gpipe_lab.bench import md_table

    assert md_table(["a", "b"], [[1, None]], lambda c: "-" if c is None else str(c)) == \
        "| a | b |\n|---|---|\n| 1 | - |"
    with pytest.raises(ValueError, match="row 1 has 1 cells; the header has 2"):
        md_table(["a", "b"], [[1, 2], [3]])


def test_progress_prints_a_line_per_job_with_the_time_left():
    import io

    from gpipe_lab.bench import Progress

    now = [100.0]
    out = io.StringIO()
    progress = Progress(4, "t2", stream=out, clock=lambda: now[0], note="writing to /x")
    now[0] += 10
    assert progress.done("K=2 M=4") == "[t2] 1/4 K=2 M=4: 10.0 s; 10 s so far, about 30 s left"
    now[0] += 110
    assert progress.done("K=1 M=1") == "[t2] 2/4 K=1 M=1: 110.0 s; 2 min 0 s so far, about 2 min 0 s left"
    now[0] += 3600
    progress.done("c")
    assert progress.done("d").endswith("1 h 2 min so far, done")
    assert out.getvalue().splitlines()[0] == "[t2] 4 jobs; writing to /x"
    with pytest.raises(ValueError, match="total=-1"):
        Progress(-1, "x", stream=out)


def test_each_run_gets_a_fresh_output_folder_unless_told_where(tmp_path):
    import datetime

    from experiments.common import parser

    from gpipe_lab.bench.machine import ROOT
    from gpipe_lab.bench.script_launch import fresh_out

    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    first = fresh_out(tmp_path, "table2", when)
    assert first == tmp_path / "table2" / "2026-01-02_03-04-05"
    first.mkdir(parents=True)
    assert fresh_out(tmp_path, "table2", when) == tmp_path / "table2" / "2026-01-02_03-04-05-1"
    default = parser("x").parse_args([]).out
    assert default.is_relative_to(ROOT / "logs" / "experiments") and not default.exists()
    assert parser("x").parse_args(["--out", "results"]).out == Path("results")


def imported_packages(folder: Path) -> dict[str, set[str]]:
    """Every top-level package each ``.py`` file under ``folder`` imports (``import x.y`` / ``from x.y import``)."""
    import ast

    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        tops = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                tops.add(node.module.split(".")[0])
        found[str(path.relative_to(folder.parent))] = tops
    return found


@pytest.mark.parametrize(("folder", "never"), [("benchmarks", {"experiments"}), ("experiments", {"benchmarks"}),
                                               ("src/gpipe_lab", {"benchmarks", "experiments"})])
def test_benchmarks_and_experiments_share_only_gpipe_lab_bench(folder, never):
    """One direction: the scripts import what they share from ``gpipe_lab.bench``, never from each other
    (``experiments.regenerate`` runs benchmark scripts as commands), and the package imports neither."""
    root = Path(__file__).resolve().parents[2]
    crossing = {f: sorted(tops & never) for f, tops in imported_packages(root / folder).items() if tops & never}
    assert not crossing, f"imports across the script packages: {crossing}"
    assert imported_packages(root / folder), f"no Python file under {folder}"

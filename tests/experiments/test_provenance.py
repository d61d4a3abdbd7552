"""Every generated JSON carries where it came from; every figure its commit (issue 30 §4)."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from experiments.common import save_figure, write  # noqa: E402
from PIL import Image  # noqa: E402

from gpipe_lab.bench.machine import provenance, provenance_meta

KEYS = {"date", "commit", "command", "host", "cpu", "cores", "gpu", "torch", "load_average"}


def test_json_twin_carries_meta_for_dicts_and_lists(tmp_path):
    write(tmp_path, "a.md", "# a", {"x": 1})
    write(tmp_path, "b.md", "# b", [{"x": 1}, {"x": 2}])
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert a["x"] == 1 and set(a["meta"]) == KEYS
    assert b["rows"] == [{"x": 1}, {"x": 2}] and set(b["meta"]) == KEYS
    assert a["meta"]["command"].startswith("python ") and isinstance(a["meta"]["load_average"], list)


def test_provenance_line_names_commit_command_and_load():
    meta = provenance_meta(["experiments/table1_capacity.py", "--out", "x"])
    line = provenance(["experiments/table1_capacity.py", "--out", "x"])
    assert meta["command"] == "python -m experiments.table1_capacity --out x"
    assert f"`{meta['commit']}`" in line and "load average" in line and meta["command"] in line


def test_png_metadata_names_the_commit(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    save_figure(fig, tmp_path / "f.png")
    plt.close(fig)
    info = Image.open(tmp_path / "f.png").info
    assert info["Source"] == f"gpipe-lab {provenance_meta()['commit']}" and "python" in info["Description"]


def test_every_figure_of_experiments_and_benchmarks_carries_its_commit():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    calls = [(p.name, line.strip()) for folder in ("experiments", "benchmarks") for p in (root / folder).rglob("*.py")
             for line in p.read_text().splitlines() if ".savefig(" in line]
    assert calls and all("metadata=" in line for _, line in calls), [c for c in calls if "metadata=" not in c[1]]
    # plot_timeline saves without metadata when given a path: the scripts draw with it and save themselves
    drawn = [(p.name, line.strip()) for folder in ("experiments", "benchmarks") for p in (root / folder).rglob("*.py")
             for line in p.read_text().splitlines() if "plot_timeline(" in line and "import" not in line]
    import re

    positional_path = re.compile(r"plot_timeline\([^,()]+(\([^()]*\))?[^,()]*,(?!\s*[\w.]+\s*=)")
    assert drawn and not [c for c in drawn if positional_path.search(c[1])]
    assert positional_path.search("plot_timeline(tl, png, title=x)")


def test_benchmark_figures_name_commit_and_module_command(monkeypatch):
    import sys

    from gpipe_lab.bench.machine import figure_metadata, git_commit

    monkeypatch.setattr(sys, "argv", [str(__import__("benchmarks.report").__path__[0]) + "/report.py", "--x"])
    meta = figure_metadata()
    assert meta["Source"] == f"gpipe-lab {git_commit()}"
    assert meta["Description"].startswith("python -m benchmarks.report --x (")


def test_jobs_record_the_commit_of_their_code_and_the_sweep_summary_shows_it(tmp_path):
    import re

    from gpipe_lab.app.sweep_summary import table_rows
    from gpipe_lab.bench.provenance import source_commit

    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", source_commit())
    assert source_commit(tmp_path) == "unknown"  # not a git checkout
    headers, rows = table_rows([{"K": 2, "M": 4, "commit": "abc123def456"}])
    assert rows[0][headers.index("commit")] == "abc123def456"


def test_the_commit_of_results_is_the_last_one_that_changed_code(tmp_path):
    import subprocess

    from gpipe_lab.bench.provenance import commit_of

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "results").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "code")
    code = git("rev-parse", "--short=12", "HEAD")
    assert commit_of(tmp_path) == code
    (tmp_path / "results" / "table.md").write_text("| a |\n")
    (tmp_path / "README.md").write_text("prose\n")
    git("add", "-A")
    git("commit", "-qm", "results and prose")
    assert commit_of(tmp_path) == code  # a regeneration that spans these commits ran one code
    (tmp_path / "README.md").write_text("more prose\n")
    assert commit_of(tmp_path) == code
    (tmp_path / "tests" / "unit").mkdir(parents=True)  # tests check the code and make no result
    for name in ("test_code.py", "conftest.py"):
        (tmp_path / "tests" / "unit" / name).write_text("def test_x(): pass\n")
    git("add", "-A")
    git("commit", "-qm", "tests")
    assert commit_of(tmp_path) == code
    (tmp_path / "tests" / "unit" / "test_code.py").write_text("def test_y(): pass\n")
    assert commit_of(tmp_path) == code
    (tmp_path / "tests" / "harness.py").write_text("writes = 'results'\n")  # a harness beside them is code
    git("add", "-A")
    git("commit", "-qm", "harness")
    code = git("rev-parse", "--short=12", "HEAD")
    assert commit_of(tmp_path) == code
    (tmp_path / "code.py").write_text("x = 2\n")
    assert commit_of(tmp_path) == code + "+dirty"
    git("commit", "-qam", "code again")
    assert commit_of(tmp_path) == git("rev-parse", "--short=12", "HEAD")
    assert commit_of(tmp_path / "missing") == "unknown"

"""Every generated JSON carries where it came from; every figure its commit (issue 30 §4)."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from experiments.common import provenance, provenance_meta, save_figure, write  # noqa: E402
from PIL import Image  # noqa: E402

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

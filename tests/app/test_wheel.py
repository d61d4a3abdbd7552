"""A non-editable install runs: the wheel carries the YAML config and finds it through the package."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH pointing at a checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", MPLBACKEND="Agg")
    env.pop("GPIPE_LAB_CONF", None)
    env.pop("GPIPE_LAB_ROOT", None)
    return env


def outer_site_dirs() -> list[str]:
    """The site-packages directories of the running interpreter (a venv's or the system's)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


@pytest.mark.slow
def test_wheel_installed_in_a_fresh_venv_runs_from_another_directory(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=300, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("gpipe_lab-*.whl"))
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("gpipe_lab/conf/")}
    expected = {f"gpipe_lab/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected and expected <= shipped, sorted(expected - shipped)

    # torch, Lightning and Hydra come from this interpreter's environment (no network), whichever way
    # it was made: a venv made inside a venv with system_site_packages sees the *base* interpreter's
    # packages, not this one's, so the new venv lists this interpreter's site directories in a .pth
    # file instead (plain paths: their own .pth files, e.g. an editable gpipe-lab, are not read).
    # --force-reinstall: the interpreter may already hold an editable gpipe-lab of the same version.
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(tmp_path / "venv")
    inner_site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (inner_site / "outer_environment.pth").write_text("\n".join(outer_site_dirs()) + "\n")
    bin_dir = tmp_path / "venv" / "bin"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q", "--no-deps", "--no-index",
                    "--force-reinstall", str(wheel)], check=True, timeout=300, env=_env())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(bin_dir / "python"), "-c", "import gpipe_lab, importlib.util; print(gpipe_lab.__file__); "
                            "print(importlib.util.find_spec('torch').origin)"],  # where torch is, without its import
                           capture_output=True, text=True, check=True, cwd=elsewhere, env=_env())
    package, torch_file = where.stdout.split()
    assert str(tmp_path / "venv") in package, where.stdout
    assert torch_file == torch.__file__, where.stdout  # this environment's torch, not the base interpreter's

    dry = subprocess.run([str(bin_dir / "gpipe-train"), "dry_run=true"], capture_output=True, text=True,
                         timeout=300, cwd=elsewhere, env=_env())
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "amoebanet_d_tiny" in dry.stdout

    two = subprocess.run([str(bin_dir / "gpipe-train"), "trainer=smoke", "trainer.max_steps=2", "logger=csv",
                          "data.num_train=64", "data.num_val=32"],
                         capture_output=True, text=True, timeout=300, cwd=elsewhere, env=_env())
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    summaries = list((elsewhere / "logs" / "train" / "runs").glob("*/summary.json"))
    assert len(summaries) == 1
    assert json.loads(summaries[0].read_text())["steps"] == 2

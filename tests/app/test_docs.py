"""The README and docs work as written: every command of their ``bash`` blocks is listed here and
either run (shrunk with small overrides appended, bounded by a timeout), or named as run by
another test (which must exist and pass the command's own overrides: checked here, so the
same process is not started twice), or skipped with the reason it cannot run in a CPU test;
the scheduling example's Python runs too.

A new command in a ``bash`` block fails ``test_every_documented_command_is_run_or_skipped_here``
until it is added to ``COMMANDS``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from helpers.forked import run_module, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

IMAGES = "trainer=smoke logger=none data.num_train=32 data.num_val=8 data.batch_size=8 model.num_filters=8 " \
         "data.image_size=8 model.image_size=8 trainer.max_steps=1"
TEXT = "trainer=smoke logger=none data.num_train=64 data.num_val=16 data.batch_size=16 trainer.max_steps=1"
DEMO = "--steps 1 --batch 16 --width 16 --hidden 32"
SLURM = "#!/bin/bash"

#: command (as written, comments and line breaks removed) -> ("run", appended arguments, setup
#: command or ""), ("covered", "file::test" that runs it, the overrides that test must pass) or
#: ("skip", why).
COMMANDS: dict[str, tuple[str, ...]] = {
    'python3 -m venv .venv && . .venv/bin/activate && python -m pip install -e ".[dev]" && gpipe-train':
        ("skip", "the fresh venv and the install are .ci/run's; gpipe-train runs below"),
    "python -m pytest -q -n auto": ("skip", "this test suite"),
    "torchrun --nproc-per-node 2 -m gpipe_lab.pipeline.distributed.demo": ("run", DEMO, ""),
    "torchrun --nproc-per-node 4 -m gpipe_lab.app.train pipeline.transport=distributed trainer=distributed "
    "pipeline.partitions=2 trainer.devices=4": ("run", IMAGES + " trainer.enable_checkpointing=false", ""),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m gpipe_lab.app.train "
    "pipeline.transport=distributed trainer=distributed pipeline.partitions=8 trainer.devices=8 trainer.num_nodes=2":
        ("skip", "needs two nodes of 8 processes"),
    "gpipe-train": ("covered", "tests/app/test_train.py::test_default_app_logs_everything_to_offline_wandb", ""),
    "gpipe-train model=transformer_tiny data=synthetic_translation":
        ("covered", "tests/app/test_app_learning.py::test_tiny_transformer_reaches_bleu_20_on_the_synthetic_language_pair",
         "model=transformer_tiny data=synthetic_translation"),
    "gpipe-train -m optimizer.lr=0.001,0.01":
        ("covered", "tests/app/test_sweep_names.py::test_a_sweep_over_the_learning_rate_names_its_runs_and_columns_by_it",
         "-m optimizer.lr=0.001,0.01"),
    "gpipe-train mode=test ckpt_path=last": ("run", IMAGES, f"gpipe-train {IMAGES} trainer.enable_checkpointing=true"),
    "gpipe-train -m pipeline.partitions=1,2 pipeline.chunks=1,4":
        ("covered", "tests/app/test_train.py::test_multirun_sweep_is_one_wandb_group_with_a_summary_table",
         "-m pipeline.partitions=1,2 pipeline.chunks=1,4"),
    "gpipe-train pipeline.schedule=zb-h1 pipeline.checkpoint=always trainer.max_steps=200 seed=1": ("run", IMAGES, ""),
    "gpipe-train logger=csv": ("covered", "tests/app/test_app_learning.py::test_default_app_is_well_above_chance",
                               "logger=csv"),
    "gpipe-train ckpt_path=last trainer.max_steps=120":
        ("covered", "tests/app/test_resume_traps.py::test_ckpt_path_last_continues_the_run_with_its_overrides_and_wandb_run",
         "ckpt_path=last"),
    "gpipe-train dry_run=true": ("covered", "tests/app/test_wheel.py::test_wheel_installed_in_a_fresh_venv_runs_from_"
                                            "another_directory", "dry_run=true"),
    "gpipe-train pipeline.compile=true": ("skip", "tests/app/test_compile_app.py trains with pipeline.compile "
                                                  "(aot_eager: inductor's C++ build takes minutes on 2 cores)"),
    "gpipe-train pipeline.transport=distributed pipeline.partitions=2":
        ("skip", "tests/app/test_multiprocess.py runs this (smoke-sized, interleaved schedule)"),
    "wandb sync logs/train/runs/<time>/wandb/offline-run-*": ("skip", "uploads to wandb.ai (network)"),
    "python experiments/table2_throughput.py experiment.chunks=[1,4]":
        ("covered", "tests/experiments/test_experiments.py::test_script_tiny_end_to_end", "experiment.chunks=[1,4]"),
    "gpipe-train -m experiment=paper_table2_amoebanet pipeline.partitions=1,2 pipeline.chunks=1,4,32":
        ("skip", "six paper-size AmoebaNet-D jobs (tens of minutes on CPU); tests/experiments runs the config"),
    "python experiments/table2_throughput.py --from-multirun logs/train/multiruns/<time>":
        ("skip", "reads the sweep above; tests/experiments/test_experiment_configs.py covers --from-multirun"),
    "gpipe-plan memory --model transformer_l --num-layers 1663 -K 128 --batch 32 --microbatches 32 --memory-gib 16":
        ("run", "| tail -1 | grep 'fits in 16 GiB'", ""),
    "torchrun --nproc-per-node 4 -m gpipe_lab.pipeline.distributed.demo --stages 2 --chunks 8": ("run", DEMO, ""),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-id job42 --rdzv-backend c10d --rdzv-endpoint node0.example:29500 "
    "-m gpipe_lab.pipeline.distributed.demo --stages 8": ("skip", "needs two nodes of 8 processes"),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-id job43 --rdzv-backend c10d --rdzv-endpoint node0.example:29500 "
    "-m gpipe_lab.app.train pipeline.transport=distributed trainer=distributed pipeline.partitions=8 trainer.devices=8 "
    "trainer.num_nodes=2": ("skip", "needs two nodes of 8 processes"),
    SLURM: ("skip", "a SLURM batch script (a cluster with GPUs)"),
    "gpipe-plan auto --model transformer_l --set num_layers=8 --set d_model=64 --set ffn_dim=256 --set num_heads=4 "
    "--set vocab_size=256 --set seq_len=32 --batch 64 --memory 24MiB --devices 2":
        ("covered", "tests/planner/test_auto.py::test_cli_prints_the_chosen_plan_and_the_runner_ups", "auto"),
    "gpipe-train pipeline.plan=auto pipeline.memory_per_device=2MiB":
        ("covered", "tests/app/test_plan_auto.py::test_plan_auto_runs_the_chosen_plan_and_records_predicted_beside_"
                    "measured", "pipeline.plan=auto pipeline.memory_per_device=2MiB"),
    "python -m experiments.plan_check --out results":
        ("skip", "about ten minutes of measuring; tests/experiments/test_plan_check.py runs --tiny"),
}


def documented_commands(path: Path) -> list[str]:
    """The commands of ``path``'s ``bash`` blocks: continuation lines joined, ``  # ...`` comments
    dropped; a block that is a script (``#!``) is one entry, its first line."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        if block.startswith("#!"):
            commands.append(block.splitlines()[0])
            continue
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


ALL = sorted({c for path in DOCS for c in documented_commands(path)})


def test_every_documented_command_is_run_or_skipped_here():
    assert [c for c in ALL if c not in COMMANDS] == []
    assert [c for c in COMMANDS if c not in ALL] == []  # no stale entry either


COVERED = sorted(c for c, how in COMMANDS.items() if how[0] == "covered")


@pytest.mark.parametrize("command", COVERED)
def test_a_covered_command_is_run_by_the_test_it_names(command):
    """The named test exists and passes the command's overrides (as separate arguments)."""
    _, where, overrides = COMMANDS[command]
    path, name = where.split("::")
    source = (ROOT / path).read_text()
    body = re.search(rf"\ndef {name}\(.*?(?=\n(?:def |@|class )|\Z)", source, flags=re.S)
    assert body is not None, f"{where}: no such test"
    module_level = source[:body.start()]
    for token in overrides.split():
        assert f'"{token}"' in body.group(0) or f'"{token}"' in module_level, f"{where} does not pass {token}"


#: console script -> the module whose ``python -m`` runs its function (``[project.scripts]``)
CONSOLE_SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.]+):\w+"$', re.search(
    r"^\[project\.scripts\]\n(.*?)\n\n", (ROOT / "pyproject.toml").read_text(), flags=re.S | re.M).group(1), flags=re.M))


#: A one-node torchrun command forks its ranks with torchrun's environment and store
#: (``run_torchrun``), saving each rank's import of torch and Lightning (about 10 CPU-seconds a rank
#: here). torchrun itself starts the 2-rank demo in ``test_gpu_check_dry_run`` (its two_gpus section).
TORCHRUN = re.compile(r"torchrun --nproc-per-node (\d+) -m ([\w.]+)(?: (.*))?$")


def shell(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``command`` as bash would. A console script of ours (optionally piped into shell
    filters) runs as its module, forked from the suite's server that imported torch and
    Lightning once (``helpers.forked``); the filters then read its output. A one-node torchrun
    command forks its ranks the same way."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "MPLBACKEND": "Agg",
           "GPIPE_LAB_ROOT": str(cwd), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
               [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    program, _, filters = command.partition(" | ")
    torchrun = TORCHRUN.match(program)
    if torchrun and not filters:
        nproc, module, rest = torchrun.groups()
        return run_torchrun(int(nproc), module, shlex.split(rest or ""), cwd=cwd, env=env, timeout=timeout)
    words = shlex.split(program)
    if words[0] not in CONSOLE_SCRIPTS or any(c in program for c in ";&<>$`"):
        return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    module = CONSOLE_SCRIPTS[words[0]]
    assert (ROOT / "src" / (module.replace(".", "/") + ".py")).read_text().rstrip().endswith(
        ("cli()", "main())")), f"python -m {module} does not run {words[0]}'s function"
    done = run_module(module, words[1:], cwd=cwd, env=env, timeout=timeout)
    if not filters or done.returncode != 0:
        return done
    piped = subprocess.run(["bash", "-c", filters], cwd=cwd, env=env, input=done.stdout, capture_output=True,
                           text=True, timeout=timeout)
    return subprocess.CompletedProcess(done.args, piped.returncode, piped.stdout, done.stderr + piped.stderr)


RUN = sorted(c for c, how in COMMANDS.items() if how[0] == "run")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("command", RUN)
def test_documented_command_runs(command, tmp_path):
    _, extra, setup = COMMANDS[command]
    for package in ("experiments", "benchmarks"):  # the repository root's packages, as a user has them
        (tmp_path / package).symlink_to(ROOT / package)
    if setup:
        done = shell(setup, tmp_path, 300)
        assert done.returncode == 0, done.stderr[-3000:]
    proc = shell(f"{command} {extra}".strip(), tmp_path, 360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_readme_scheduling_example_runs(tmp_path, monkeypatch):
    from torch import nn

    from gpipe_lab import GPipe

    code = re.search(r"```python\n(from gpipe_lab.pipeline import get_schedule.*?)```",
                     (ROOT / "README.md").read_text(), flags=re.S)
    assert code is not None, "the scheduling example (starting with its get_schedule import) is gone"
    pipe = GPipe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), partitions=2, chunks=8)
    import torch

    pipe.train_step(torch.randn(16, 4), torch.randn(16, 4), nn.functional.mse_loss)
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), "README.md", "exec"), {"pipe": pipe})  # noqa: S102 - the README's own code
    assert (tmp_path / "timeline.png").exists()


#: A repository path named in the README or docs (``tests/app/test_docs.py``, ``conf/pipeline/``).
PATH = re.compile(r"`((?:tests|src|conf|experiments|benchmarks|docs|results|\.ci)/[A-Za-z0-9_./*-]*)")


#: Paths the docs name as not written yet, and what writes them.
NOT_YET: dict[str, str] = {}


def test_every_path_the_docs_name_exists():
    named = {(path.name, m) for path in DOCS for m in PATH.findall(path.read_text())}
    missing = sorted((doc, p) for doc, p in named
                     if p not in NOT_YET and not ((ROOT / p.rstrip(".")).exists() or ("*" in p and list(ROOT.glob(p)))))
    assert missing == []

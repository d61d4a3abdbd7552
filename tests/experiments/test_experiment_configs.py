"""The paper experiments' Hydra configs are the scripts' single source of truth.

Every ``paper_*`` config composes and validates and names its script and commands; each
script takes its settings from its config (checked by running ``main()`` with the
expensive part stubbed out and an override on the command line); a real tiny
``gpipe-train -m`` sweep is collected by ``--from-multirun`` into a table with the
paper's column.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

from gpipe_lab.app.config.experiments import compose_experiment
from helpers.forked import run_module

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
CONF = ROOT / "conf" / "experiment"
PAPER_CONFIGS = sorted(p.stem for p in CONF.glob("paper_*.yaml"))
SCRIPTS = ["table1_capacity.py", "table2_throughput.py", "table3_throughput.py", "overheads.py",
           "trainability.py", "nmt_scaling.py"]


@pytest.fixture(scope="module")
def scripts() -> object:
    """Import experiment modules by name (``scripts("table2_throughput")``)."""
    return lambda name: importlib.import_module(f"experiments.{name}")


def compose(name: str, *overrides: str) -> object:
    return compose_experiment(name, list(overrides))


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_composes_validates_and_names_its_script_and_commands(name: str) -> None:
    from gpipe_lab.app.config.groups import validate

    text = (CONF / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    cfg = compose(name)
    validate(cfg)
    script = cfg.experiment.script
    assert (EXPERIMENTS / script).exists(), f"{name}: experiment.script {script} does not exist"
    assert f"experiments/{script}" in text, f"{name}: header lacks the script's command"
    assert "gpipe-train" in text, f"{name}: header lacks the gpipe-train command"


def test_every_table_script_has_a_config() -> None:
    named = {compose(n).experiment.script for n in PAPER_CONFIGS}
    assert set(SCRIPTS) <= named, f"scripts without a paper_* config: {set(SCRIPTS) - named}"


def test_bad_names_overrides_and_multirun_dirs_are_named(tmp_path: Path, scripts: object) -> None:
    common, multirun = scripts("common"), scripts("multirun")
    with pytest.raises(ValueError, match=r"unknown experiment 'paper_nope'; allowed: .*paper_table1_capacity"):
        compose_experiment("paper_nope")
    args = common.parser("x", ["paper_overheads"]).parse_args(["bogus"])
    with pytest.raises(ValueError, match="override 'bogus' is not key=value"):
        common.configs(args, ["paper_overheads"])
    with pytest.raises(multirun.MultirunError, match="nowhere"):
        multirun.load_runs([tmp_path / "nowhere"])
    with pytest.raises(ValueError, match=f"no finished gpipe-train job of experiment=paper_x under {tmp_path}"):
        multirun.load_runs([tmp_path], ["paper_x"])
    with pytest.raises(ValueError, match="unknown column 'Pipeline-3'"):
        t1 = scripts("table1_capacity")
        t1.column(compose("paper_table1_capacity", "+experiment.amoebanet.columns.Pipeline-3=[3,3,8]")
                  .experiment.amoebanet, "Pipeline-3", t1.AMOEBA_PAPER, 3)


def run_main(module: object, monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    module.main()


def test_table1_reads_the_planner_settings(tmp_path: Path, scripts: object) -> None:
    t1 = scripts("table1_capacity")
    a = compose("paper_table1_capacity", *t1.TINY["paper_table1_capacity"], "experiment.amoebanet.memory_gib=16",
                "experiment.amoebanet.bytes_per_param=16").experiment.amoebanet
    assert t1.column(a, "Pipeline-2", t1.AMOEBA_PAPER, 3) == [2, 3, 16]
    plan = t1.amoeba_plan(a, 3, 8, 2, a.batch, True)
    assert plan.capacity_bytes == 16 * 2**30
    assert plan.partitions[0].parameter_bytes == 16 * plan.partitions[0].params


def fake_grid(calls: list) -> object:
    def run_grid(work: object, measured_k: list, simulated_k: list, chunks: list, steps: int, repeat: int,
                 gpu: bool = False, emulated_k: list | None = None, emulated_ms: float = 0.0,
                 progress: object = None) -> list[dict]:
        calls.append((work, measured_k, simulated_k, chunks, steps, repeat, emulated_k, emulated_ms))
        emulated_k = emulated_k or []
        return [{"workload": work.name, "K": k, "M": m, "batch": work.batch, "balance": [1] * k,
                 "measured_s": 1.0 if k in measured_k else None, "simulated_s": 1.0, "hop_s": 0.0,
                 "sim_error": 0.0 if k in measured_k else None,
                 "measured_sps": 10.0 * k / m if k in measured_k else None, "simulated_sps": 10.0 * k / m,
                 "measured_bubble": 0.1 if k in measured_k else None, "simulated_bubble": 0.1,
                 "emulated_s": 1.0 if k in emulated_k else None,
                 "emulated_sps": 10.0 * k / m if k in emulated_k else None,
                 "emulated_sim_s": 1.0 if k in emulated_k else None,
                 "emulated_error": 0.0 if k in emulated_k else None,
                 "emulated_bubble": 0.1 if k in emulated_k else None}
                for m in chunks for k in sorted({*measured_k, *simulated_k, *emulated_k})]
    return run_grid


@pytest.mark.parametrize("script", ["table2_throughput", "table3_throughput"])
def test_throughput_scripts_run_what_their_configs_say(script: str, tmp_path: Path, scripts: object,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    module, calls = scripts(script), []
    import experiments.throughput_grid as grid  # the scripts run their grids through run_grids

    monkeypatch.setattr(grid, "run_grid", fake_grid(calls))
    run_main(module, monkeypatch, "--tiny", "--out", str(tmp_path), "model.num_filters=16",
             "experiment.chunks=[1,32]", "experiment.steps=2")
    assert [c[0].name for c in calls] == ["amoeba", "transformer"]
    amoeba, transformer = calls
    assert amoeba[0].sizes["num_filters"] == 16 and amoeba[0].sizes["num_layers"] == 3  # tiny, then ours
    assert transformer[0].sizes["num_layers"] == 8 and transformer[0].preset == "transformer_l"
    assert amoeba[3] == [1, 32] and amoeba[4] == 2
    assert amoeba[6] == [1, 2] and amoeba[7] == 8.0  # --tiny's emulated devices
    text = (tmp_path / f"{script}.md").read_text()
    assert "3.48" in text if script == "table2_throughput" else "2.7" in text  # the paper's column


def test_overheads_reads_its_workloads(tmp_path: Path, scripts: object, monkeypatch: pytest.MonkeyPatch) -> None:
    module, seen = scripts("overheads"), []

    def breakdown(work: object, chunks: int, steps: int, cost: object, out: Path, k: int = 2) -> tuple[dict, Path]:
        seen.append((work.name, work.batch, chunks, k))
        row = dict.fromkeys(("recompute", "bubble_measured", "bubble_theory", "bubble_simulated", "imbalance",
                             "wait", "handover_share", "handover_ms", "update_share", "wall_s"), 0.1)
        return {**row, "workload": work.name, "K": k, "M": chunks, "balance": [1, 1]}, out / "x.png"

    monkeypatch.setattr(module, "breakdown", breakdown)
    monkeypatch.setattr(module, "workload_cost", lambda *args: None)
    monkeypatch.setattr(module, "engine_overhead", lambda: 0.0)
    run_main(module, monkeypatch, "--tiny", "--out", str(tmp_path), "experiment.chunks=[8]",
             "experiment.workloads.transformer.batch=16")
    assert seen == [("amoeba", 64, 8, 2), ("transformer", 16, 8, 2)]
    assert "23%" in (tmp_path / "overheads.md").read_text()


def test_nmt_scaling_trains_what_its_config_says(tmp_path: Path, scripts: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    module, nmt_lib, calls = scripts("nmt_scaling"), scripts("nmt_lib"), []

    def train_translation(steps: int, **kwargs: object) -> object:
        calls.append({"steps": steps, **kwargs})
        return nmt_lib.RunResult(losses=[1.0] * 12, grad_norms=[1.0] * 12, val_nll=1.0, bleu=1.0, params=10,
                                 tokens_per_step=5.0)

    monkeypatch.setattr(module, "train_translation", train_translation)
    run_main(module, monkeypatch, "--tiny", "--out", str(tmp_path), "optimizer.lr=0.05", "trainer.max_steps=3")
    assert calls and all(c["lr"] == 0.05 and c["steps"] == 3 and c["d_model"] == 16 for c in calls)
    assert [c.get("tokens_per_batch") for c in calls] == [None, None, 64, 256, 1024]
    assert {c["num_layers"] for c in calls[:2]} == {4, 2} and calls[0]["warmup"] == 10
    assert "32.71" in (tmp_path / "nmt_scaling.md").read_text()


@pytest.mark.slow
def test_tiny_multirun_is_collected_into_table2(tmp_path: Path, scripts: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    sweep = tmp_path / "sweep"
    train = run_module(
        "gpipe_lab.app.train", ["-m", "experiment=paper_table2_amoebanet", "pipeline.partitions=2",
         "pipeline.chunks=1,4", "trainer=smoke", "trainer.max_steps=1", "trainer.limit_val_batches=1",
         "model.num_layers=3", "model.num_filters=8", "data.batch_size=64", "data.num_train=128", "data.num_val=32",
         "logger=none",
         f"paths.log_dir={tmp_path}", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, timeout=240)
    assert train.returncode == 0, train.stderr[-3000:]
    assert len(list(sweep.glob("*/summary.json"))) == 2
    out = tmp_path / "out"
    run_main(scripts("table2_throughput"), monkeypatch, "--from-multirun", str(sweep), "--out", str(out))
    text = (out / "table2_throughput.md").read_text()
    row_m1 = next(line for line in text.splitlines() if line.startswith("| AmoebaNet-D(18, 256) analogue | 1 |"))
    assert row_m1.split(" | ")[2:] == ["1.00", "1", "1.13", "1.38 |"]  # ours (basis), the paper's K=2,4,8
    assert "| 1.07 | 1.26 | 1.72 |" in text  # the paper's M=4 row
    assert (out / "table2_throughput.png").stat().st_size > 0
    rows = json.loads((out / "table2_throughput.json").read_text())["rows"]
    assert sorted((r["K"], r["M"]) for r in rows) == [(2, 1), (2, 4)] and all(r["measured_sps"] for r in rows)
    assert all(r["commit"] and r["threads"] >= 2 for r in rows)  # each job's own commit; its stages' threads


def fake_job(sweep: Path, num: int, experiment: str, overrides: list[str], **summary: object) -> None:
    """A job folder as gpipe-train -m writes it (summary.json, .hydra/config.yaml, .hydra/overrides.yaml)."""
    from omegaconf import OmegaConf

    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose(experiment, *overrides)))
    (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml([f"experiment={experiment}", *overrides]))
    base = {"K": 2, "M": 4, "samples_per_s": 10.0, "tokens_per_s": 100.0, "final_train_loss": 2.0, "val_loss": 2.5,
            "validation_value": 1.0, "seed": 0, "bubble_measured": 0.2, "bubble_theory": 0.2, "balance": [1, 1],
            "stage_busy_s": [1.0, 0.9], "stage_parameter_bytes": [400, 400]}
    (job / "summary.json").write_text(json.dumps({**base, **summary}))


@pytest.mark.parametrize(("script", "jobs", "expected"), [
    ("table3_throughput", [("paper_table3_amoebanet", [], {"K": 1, "M": 32}),
                           ("paper_table3_amoebanet", [], {"K": 2, "M": 32, "samples_per_s": 15.0})],
     ["| AmoebaNet-D(18, 128) analogue | 32 | 0.67 | 1.00 | 1 | 1.7 | 2.7 |"]),
    ("trainability", [("paper_trainability", ["model.ffn_init_scaling=false", "model.logit_clip=null"], {}),
                      ("paper_trainability", [], {"seed": 1})],
     ["| none | 48 | 1 ([0]) | 2.000 ± 0.000", "| both | 48 | 1 ([1]) |", "(i) + (ii)"]),
    ("nmt_scaling", [("paper_nmt_deep", [], {}), ("paper_nmt_wide", [], {"val_loss": 3.0}),
                     ("paper_nmt_batch", ["data.tokens_per_batch=128"], {})],
     ["| deep | {'num_layers': 8", "| 2.500 | 1.000 | T(24, 8192, 16)", "| 128 | 1 | 100.000 | 2.500 | 1.000 | 260K | 30.92 | 2.58 |"]),
    ("overheads", [("paper_overheads", [], {})], ["| 3.2% (K=2) |", "| 20.0% | 20.0% | - | 5.0% |"]),
])
def test_collectors_build_the_paper_tables_from_job_folders(script: str, jobs: list, expected: list[str],
                                                             tmp_path: Path, scripts: object,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for num, (experiment, overrides, summary) in enumerate(jobs):
        fake_job(tmp_path / "sweep", num, experiment, overrides, **summary)
    fake_job(tmp_path / "sweep", len(jobs), "paper_table2_amoebanet", [])  # another experiment's job: ignored
    run_main(scripts(script), monkeypatch, "--from-multirun", str(tmp_path / "sweep"), "--out", str(tmp_path / "out"))
    text = (tmp_path / "out" / f"{script}.md").read_text()
    for line in expected:
        assert line in text, f"{line!r} not in {script}.md:\n{text}"
    assert f"Collected from {len(jobs)} gpipe-train job(s)" in text


def test_table2_collector_states_the_pipelining_gain_of_each_model(tmp_path: Path, scripts: object,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = ["pipeline.compile=true"]
    for num, (overrides, summary) in enumerate([(compiled, {"K": 1, "M": 1, "samples_per_s": 10.0}),
                                                (compiled, {"K": 2, "M": 1, "samples_per_s": 12.0}),
                                                (compiled, {"K": 2, "M": 4, "samples_per_s": 15.0}),
                                                (compiled, {"K": 2, "M": 32, "samples_per_s": 5.0})]):
        fake_job(tmp_path / "sweep", num, "paper_table2_transformer", overrides, **summary)
    fake_job(tmp_path / "sweep", 4, "paper_table2_amoebanet", [], K=2, M=4)  # no K=1 job: no sentence
    run_main(scripts("table2_throughput"), monkeypatch, "--from-multirun", str(tmp_path / "sweep"),
             "--out", str(tmp_path / "out"))
    text = (tmp_path / "out" / "table2_throughput.md").read_text()
    assert ("- Transformer-48 analogue (compiled stages): K=2 at its fastest M (M=4, 15.00 samples/s, ? threads in "
            "all) is 1.50x the unpipelined job (K=1, M=1, 10.00 samples/s, ? threads); in the table's normalization "
            "(K=2, M=1 = 1.00) K=1, M=1 is 0.83 and K=2, M=4 is 1.25; fewer than 3 repeats (1 and 1): no spread "
            "to judge it by.") in text
    assert "AmoebaNet-D(18, 256) analogue (" not in text

"""The benchmark runner in ``--smoke`` mode: structure of its outputs and memory consistency.

No timing is asserted: the machine may be busy. Memory is counted
deterministically, so its relations (``always`` < ``never``, 1F1B ≤ GPipe on
stage 0, the closed-form MLP model) are checked exactly.
"""

from __future__ import annotations

import json
import math
import os
import select
import statistics
from pathlib import Path

import pytest
from benchmarks import (
    bench_app,
    bench_ceiling,
    bench_gloo,
    bench_memory,
    bench_yardstick,
    diagnose,
    report,
    run,
    targets,
)
from benchmarks import bench_common as common

from helpers.forked import run_module

TARGET_KEYS = {"name", "value", "unit", "goal", "status"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert run.main(["--smoke", "--no-distributed", "--out", str(out)]) == 0
    return out, json.loads((out / "benchmarks.json").read_text())


def test_outputs_exist(smoke):
    out, _ = smoke
    md = (out / "benchmarks.md").read_text()
    for heading in ("## Targets", "## Against plain PyTorch", "## Throughput, local transport",
                    "## Scheduling overhead", "## Memory"):
        assert heading in md
    assert "cores" in md and "torch" in md and "--smoke" in md
    assert "s (local " in md and ", yardstick " in md  # the wall time per section
    assert "same with random_replay=False µs" in md and "replay guard's share of the step" in md
    assert "same, counting every forward µs" in md
    for png in ("throughput.png", "bubble.png", "memory.png"):
        assert (out / "benchmarks" / png).stat().st_size > 0


def test_json_structure(smoke):
    _, res = smoke
    assert {"meta", "local", "memory", "overhead", "targets", "notes", "gloo", "yardstick"} <= set(res)
    assert {"date", "command", "machine", "mode", "load_before", "load_after"} <= set(res["meta"])
    assert res["meta"]["mode"] == "smoke"
    sections = res["meta"]["sections_s"]  # where the run's time went, within its wall time
    assert set(sections) == {"local", "memory", "yardstick", "overhead"} and min(sections.values()) > 0
    assert sum(sections.values()) <= res["meta"]["duration_s"]
    assert set(res["local"]) == {"mlp", "transformer", "amoebanet"}
    for name, entry in res["local"].items():
        assert entry["baseline_s"] > 0, name
        for row in entry["rows"]:
            assert row["step_s"] > 0 and 0 <= row["bubble_theory"] < 1
            assert row["baseline_s"] > 0
            assert row["speedup"] == pytest.approx(row["baseline_s"] / row["step_s"])
    ceiling = res["local"]["mlp"]["ceiling"]["4"]  # smoke: the M of the torch comparison
    assert ceiling["parallel_scaling"] == pytest.approx(ceiling["sequential_s"] / ceiling["parallel_s"])
    assert ceiling["ceiling_step_s"] == pytest.approx(ceiling["parallel_s"] * (4 + 1) / 4)
    row = next(r for r in res["local"]["mlp"]["rows"] if (r["M"], r["checkpoint"], r["schedule"]) ==
               (4, "never", "gpipe"))
    assert row["fraction_of_ceiling"] == pytest.approx(ceiling["ceiling_step_s"] / row["step_s"])
    assert res["meta"]["allocator"]
    assert res["overhead"]["actions"] == 2 * 2 * res["overhead"]["microbatches"]
    assert all(math.isfinite(res["overhead"][k]) for k in ("overhead_without_replay_us", "replay_guard_share"))
    for t in res["targets"]:
        assert set(t) == TARGET_KEYS and t["status"] in ("PASS", "MISS", "N/A")
    assert len(res["targets"]) == 42
    for schedule in ("gpipe-bw", "zb-h1", "zb-h2"):
        assert any(t["name"].startswith(f"MLP M=8 {schedule} (distributed transport)") for t in res["targets"])
    mlp_local = {r["schedule"] for r in res["local"]["mlp"]["rows"]}
    assert {"gpipe", "1f1b", "gpipe-bw", "zb-h1", "zb-h2"} <= mlp_local
    if res["gloo"]:  # ours (every schedule) and torch alternate in one group per M
        assert {(r["framework"], r["schedule"]) for r in res["gloo"] if r["workload"] == "mlp"} >= {
            ("torch", "gpipe"), ("torch", "1f1b"), ("ours", "gpipe"), ("ours", "1f1b"), ("ours", "gpipe-bw"),
            ("ours", "zb-h1"), ("ours", "zb-h2")}


def test_yardstick_rows_are_ratios_of_one_run_and_targets_read_them(smoke):
    _, res = smoke
    assert [r["workload"] for r in res["yardstick"]] == ["mlp"]  # smoke: the MLP only
    for r in res["yardstick"]:
        steps = r["step_s"]
        assert set(steps) == {"plain", *bench_yardstick.ENGINES, bench_yardstick.TIME_BALANCED}
        assert min(steps.values()) > 0
        assert r["M"] == 4 and r["batch"] > 0
        rounds = r["rounds_s"]  # each ratio: the median of its contenders' per-round ratios
        assert {len(v) for v in rounds.values()} == {r["rounds"]} and steps["plain"] == statistics.median(rounds["plain"])

        def paired(a: str, b: str, rounds: dict = rounds) -> float:
            return statistics.median(x / y for x, y in zip(rounds[a], rounds[b]))

        assert r["overhead"]["K=1"] == pytest.approx(paired("K=1", "plain"))
        assert r["gain"]["K=2, no replay"] == pytest.approx(paired("plain", "K=2, no replay"))
        timed = r["gain"][bench_yardstick.TIME_BALANCED]
        assert timed == pytest.approx(paired("plain", bench_yardstick.TIME_BALANCED))
        assert sum(r["balance"][bench_yardstick.TIME_BALANCED]) == sum(r["balance"]["K=2"])
        row = next(t for t in res["targets"] if t["name"].startswith(f"{r['workload']} M=4: the same gain, K=2 cut"))
        assert row["value"] == round(timed, 4) and row["status"] in ("PASS", "MISS")
        row = next(t for t in res["targets"] if t["name"].startswith(f"{r['workload']} M=4: engine K=1"))
        assert row["value"] == round(r["overhead"]["K=1"], 4) and row["status"] in ("PASS", "MISS")
        assert r["replay_cost"]["K=2"] == pytest.approx(paired("K=2", "K=2, no replay") - 1)
        row = next(t for t in res["targets"] if t["name"].startswith(f"{r['workload']} K=2 M=4: random replay"))
        assert row["value"] == round(r["replay_cost"]["K=2"], 4) and row["status"] in ("PASS", "MISS")
        ceiling = r["ceiling"]  # the K=2 stages' own work, timed in the same rounds
        assert len(ceiling["stage_s"]) == 2 and min(ceiling["stage_s"]) > 0
        assert ceiling["imbalance"] == pytest.approx(max(ceiling["stage_s"]) / statistics.fmean(ceiling["stage_s"]))
        assert ceiling["lower_bound_s"] == pytest.approx(bench_ceiling.pipeline_lower_bound(ceiling["stage_s"], 4))
        assert ceiling["gain"] == pytest.approx(steps["plain"] / ceiling["lower_bound_s"])
        assert ceiling["fraction"] == pytest.approx(ceiling["lower_bound_s"] / steps["K=2"])
    unmeasured = [t for t in res["targets"] if t["name"].startswith(("transformer M=4", "amoebanet M=4",
                                                                     "amoebanet K=2", "transformer dropout"))]
    assert len(unmeasured) == 8 and {t["status"] for t in unmeasured} == {"N/A"}


def test_plain_gradient_accumulation_computes_the_engines_gradients():
    sizes = common.SIZES["smoke"]
    plain = common.make_workload("mlp", sizes, partitions=1)
    bench_yardstick.plain_step(plain, 4, "cpu")()
    piped = common.make_workload("mlp", sizes, partitions=2)
    bench_yardstick.engine(piped, 4, "cpu", random_replay=True).train_step(piped.inputs, piped.targets,
                                                                           piped.loss_fn)
    for (name, a), b in zip(plain.module.named_parameters(), piped.module.parameters()):
        assert a.grad is not None and b.grad is not None, name
        assert (a.grad - b.grad).abs().max() <= 1e-5 * max(1.0, b.grad.abs().max().item()), name


@pytest.mark.parametrize("name", ["transformer", "amoebanet"])
def test_the_ceiling_runs_each_stage_of_a_tuple_or_image_workload(name):
    """The machine ceiling's stage jobs take tuple values between stages (the Transformer) and
    reach every parameter of both stages, as the pipelined step does."""
    work = common.make_workload(name, common.SIZES["smoke"], partitions=2)
    reached: set[str] = set()
    for n, p in work.module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: reached.add(n))
    times: list[list[float]] = [[], []]
    bench_ceiling.ceiling_functions(work, 4, times)["sequential"]()
    assert reached == {n for n, _ in work.module.named_parameters()} and [len(t) for t in times] == [1, 1]
    summary = bench_ceiling.ceiling_summary([2.0], [1.25], 4, [[1.5], [0.5]])
    assert summary["parallel_scaling"] == pytest.approx(1.6) and summary["ceiling_step_s"] == pytest.approx(1.5625)
    assert summary["imbalance"] == pytest.approx(1.5)


def test_missed_yardstick_targets_are_explained_from_their_own_numbers():
    row = {"workload": "amoebanet", "M": 4, "step_s": {"plain": 0.2}, "overhead": {"K=1": 1.1, "K=1, no replay": 1.04},
           "gain": {"K=2": 1.1, "K=2, no replay": 1.15}, "replay_cost": {"K=1": 0.05, "K=2": 0.04},
           "ceiling": {"stage_s": [0.12, 0.08], "imbalance": 1.2, "parallel_scaling": 1.6, "gain": 1.25,
                       "fraction": 0.88, "lower_bound_s": 0.16}}
    names = ["amoebanet M=4: engine K=1 / plain gradient accumulation (overhead)",
             "amoebanet M=4: plain gradient accumulation / engine K=2 (gain)",
             "amoebanet K=2 M=4: random replay's cost (draws nothing)"]
    results = {"meta": {"load_before": [0.1], "machine": {"cores": 2}}, "yardstick": [row],
               "overhead": {"overhead_per_action_us": 50.0, "replay_guard_share": 0.01},
               "targets": [{"name": n, "goal": g, "status": "MISS"} for n, g in zip(names, ["<= 1.05", ">= 1.3x",
                                                                                          "<= 0.02"])]}
    notes = diagnose.diagnose(results)
    overhead = next(n for n in notes if n.startswith("amoebanet K=1 overhead"))
    assert "1.100 with random replay" in overhead and "8 actions would cost 0.2%" in overhead  # 8 * 50 us / 0.2 s
    gain = next(n for n in notes if n.startswith("amoebanet K=2 gain"))
    assert "= 0.1600 s: the gain is at most 1.25x" in gain and "imbalance 1.20" in gain
    assert "the goal is above what any K=2 schedule of these stages could gain" in gain  # 1.25 < 1.3
    row["ceiling"]["gain"] = 1.4
    gain = next(n for n in diagnose.diagnose(results) if n.startswith("amoebanet K=2 gain"))
    assert "the remaining 12% of the bound" in gain
    replay = next(n for n in notes if n.startswith("Random replay"))
    assert "amoebanet K=1 +5.0% / K=2 +4.0%" in replay and "+1.0% of the step" in replay


def _peak(rows, m, schedule, checkpoint, stage):
    return next(r["peak_activation_bytes"] for r in rows
                if (r["M"], r["schedule"], r["checkpoint"], r["stage"]) == (m, schedule, checkpoint, stage))


@pytest.mark.parametrize("name", ["mlp", "transformer", "amoebanet"])
def test_memory_consistent(smoke, name):
    _, res = smoke
    mem = res["memory"][name]
    rows = mem["activations"]
    m = rows[0]["M"]
    for k in range(2):
        assert _peak(rows, m, "gpipe", "always", k) < _peak(rows, m, "gpipe", "never", k)
        assert _peak(rows, m, "gpipe", "always", k) <= _peak(rows, m, "gpipe", "except_last", k)
        assert _peak(rows, m, "1f1b", "never", k) <= _peak(rows, m, "gpipe", "never", k)
    for p in mem["parameters"]:
        assert p["adam_state_bytes"] == 2 * p["parameter_bytes"] == 2 * p["sgd_momentum_state_bytes"] > 0


def test_mlp_memory_model_matches_closed_form():
    sizes = common.SIZES["smoke"]
    work = common.make_workload("mlp", sizes)
    width, hidden = sizes.mlp_hidden
    for chunks in (1, 4):
        model = bench_memory.memory_model(work, chunks)
        for k in range(2):
            expected = bench_memory.mlp_closed_form(sizes.mlp_batch, width, hidden, 4, chunks, k == 1)
            assert model[k]["model_always_bytes"] == expected


def test_targets_na_without_data():
    rows = targets.evaluate({"meta": {}})
    assert all(r["status"] == "N/A" for r in rows)


@pytest.mark.distributed
def test_gloo_cases_run():
    cases = [bench_gloo.GlooCase("mlp", "ours", "gpipe", 2), bench_gloo.GlooCase("mlp", "torch", "gpipe", 2)]
    rows = bench_gloo.run_gloo(cases, "smoke", timeout=240)
    assert [r["framework"] for r in rows] == ["ours", "torch"]
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["step"]["median"] > 0
        # the baseline is timed in the group's own rounds: one value for the group, each row divided by it
        assert r["baseline_s"] == rows[0]["baseline_s"] > 0
        assert r["speedup"] == pytest.approx(r["baseline_s"] / r["step"]["median"])
        # the stages' own work, timed alone in the same rounds, bounds any schedule of them
        s0, s1 = r["stage_alone_s"]
        assert min(s0, s1) > 0 and r["lower_bound_s"] == pytest.approx(max(s0 + s1 / 2, s1 + s0 / 2))


def test_the_lower_bound_of_any_schedule_and_what_it_says_of_torch():
    assert bench_ceiling.pipeline_lower_bound([0.8, 0.4], 4) == pytest.approx(0.9)  # 0.8 + 0.4 / 4
    with pytest.raises(ValueError, match="K=2 stages, got 3"):
        bench_ceiling.pipeline_lower_bound([1.0, 1.0, 1.0], 4)
    rows = [{"framework": "torch", "schedule": s, "chunks": 8, "step": {"median": t}, "lower_bound_s": 1.0,
             "stage_alone_s": [0.5, 0.5], "error": None} for s, t in (("gpipe", 1.05), ("1f1b", 1.08))]
    note = diagnose._bound_notes({"gloo": rows})[0]
    assert "at most 1.05x" in note and "more than 1.08x faster than torch" in note and "below the 1.1x goal" in note
    rows[1]["step"]["median"] = 1.2
    assert "below" not in diagnose._bound_notes({"gloo": rows})[0]


def test_rerender_from_json(smoke, tmp_path):
    out, res = smoke
    assert run.main(["--from-json", str(out / "benchmarks.json"), "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "benchmarks.json").read_text())
    assert again["targets"] == res["targets"]
    md = (tmp_path / "benchmarks.md").read_text()
    assert md.startswith("# GPipe Lab benchmarks")
    for t in res["targets"]:  # printed as stored (4 decimals), not rounded a second time
        if t["value"] is not None:
            assert f"| {t['name']} | {t['value']:.4f}" in md


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_product_path_row_on_the_distributed_transport(tmp_path):
    """Lightning launches the two stage processes; rank 0 alone prints both paths' step times."""
    root = Path(__file__).parents[2]
    proc = run_module("benchmarks.bench_product_path", ["--model", "transformer", "--quick", "--layers", "2",
                                                        "--transport", "distributed", "--repeats", "1", "--warmup", "0"],
                      cwd=root, timeout=240,
                      env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-3000:]  # one result: rank 1 prints none
    row = json.loads(lines[0])
    assert (row["transport"], row["K"], row["M"], row["rounds"]) == ("distributed", 2, 4, 1)
    assert row["product_step_s"] > 0 and row["raw_step_s"] > 0
    assert row["ratio"] == pytest.approx(row["raw_step_s"] / row["product_step_s"])


def test_app_rows_keep_each_rows_command_and_a_failures_error(monkeypatch):
    row = {"model": "transformer", "transport": "local", "K": 2, "M": 4, "product_step_s": 0.2,
           "raw_step_s": 0.19, "ratio": 0.95, "rounds": 6}

    def fake_run(args, timeout):
        if args[args.index("--transport") + 1] == "distributed":
            return "", "exit 1: ['RuntimeError: gloo']"
        return "log line\n" + json.dumps({**row, "model": args[args.index("--model") + 1]}) + "\n", None

    monkeypatch.setattr(bench_app, "_run", fake_run)
    rows = bench_app.run_product_rows(quick=True, repeats=6)
    assert [(r["model"], r["transport"]) for r in rows] == list(bench_app.PRODUCT_CASES)
    assert rows[0]["ratio"] == 0.95 and "--quick" in rows[0]["command"] and "error" not in rows[0]
    assert rows[2]["error"] == "exit 1: ['RuntimeError: gloo']" and "--transport distributed" in rows[2]["command"]


def test_app_rows_are_reported_and_judged(smoke, tmp_path):
    _, res = smoke
    res = {**res, "product": [
        {"model": "transformer", "transport": "local", "K": 2, "M": 4, "product_step_s": 0.2, "raw_step_s": 0.196,
         "ratio": 0.98, "rounds": 6, "command": "python -m benchmarks.bench_product_path --model transformer"},
        {"model": "amoebanet", "transport": "local", "K": 2, "M": 4, "product_step_s": 0.3, "raw_step_s": 0.24,
         "ratio": 0.8, "rounds": 6, "command": "python -m benchmarks.bench_product_path --model amoebanet"},
        {"model": "transformer", "transport": "distributed", "error": "timed out after 9 s", "command": "x"}],
        "compile": [{"model": "transformer", "K": 2, "M": 4, "eager_step_s": 0.4, "compiled_step_s": 0.3,
                     "speedup": 4 / 3, "compile_s": 147.0, "command": "python -m benchmarks.bench_compile"}]}
    status = {t["name"]: t["status"] for t in targets.evaluate(res)}
    assert status["gpipe-train / raw engine, transformer K=2 M=4 (local transport)"] == "PASS"
    assert status["gpipe-train / raw engine, amoebanet K=2 M=4 (local transport)"] == "MISS"
    assert status["gpipe-train / raw engine, transformer K=2 M=4 (distributed transport)"] == "N/A"
    report.write_report({**res, "targets": targets.evaluate(res)}, tmp_path, None)
    md = (tmp_path / "benchmarks.md").read_text()
    assert "## Product path" in md and "`python -m benchmarks.bench_product_path --model amoebanet`" in md
    assert "timed out after 9 s" in md and "## Compiled stages" in md and "| 147.000 |" in md


def test_a_row_process_that_fails_gives_its_exit_and_last_error_line():
    out, error = bench_app._run(["benchmarks.no_such_benchmark"], timeout=120)
    assert error is not None and error.startswith("exit 1") and "No module named" in error, error


def test_a_compile_row_that_times_out_keeps_what_it_measured(monkeypatch):
    measured = {"model": "amoebanet", "K": 2, "M": 4, "eager_step_s": 0.2, "compiled_step_s": 0.1, "speedup": 2.0,
                "compile_s": 90.0}
    answers = {("transformer", "4"): ("", "exit 1: ['InductorError']"),
               ("transformer", "32"): ("", None),
               ("amoebanet", "4"): ("compiling\n" + json.dumps(measured) + "\n", None),
               ("amoebanet", "32"): ("compiling\n", "timed out after 60 s")}
    caches = []

    def fake_run(args, timeout, env=None):
        caches.append(env["TORCHINDUCTOR_CACHE_DIR"])
        return answers[args[args.index("--models") + 1], args[args.index("--chunks") + 1]]

    monkeypatch.setattr(bench_app, "_run", fake_run)
    rows = bench_app.run_compile_rows(quick=False, chunks=(4, 32), repeats=5, timeout=60)
    assert len(set(caches)) == 4  # each (model, M) compiles from an empty cache of its own
    assert [(r["model"], r["K"], r["M"], r.get("error")) for r in rows] == [
        ("transformer", 2, 4, "exit 1: ['InductorError']"), ("transformer", 2, 32, "no rows"),
        ("amoebanet", 2, 4, None), ("amoebanet", 2, 32, "timed out after 60 s")]
    assert [r["command"].split("--chunks ")[1].split()[0] for r in rows] == ["4", "32", "4", "32"]


def test_a_row_process_past_its_timeout_is_ended_with_its_children():
    # the row process starts a child that would outlive it, prints the child's pid, then blocks
    block = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
             "print(child.pid, flush=True); child.wait()")
    # two bare interpreters (no torch) start in well under a second; 8 s leaves room for a loaded suite
    out, error = bench_app._run(["timeit", "-n", "1", "-r", "1", block], timeout=8)
    assert error == "timed out after 8 s"
    assert out.split(), "the row process printed nothing before its timeout"
    pid = int(out.split()[0])
    # SIGKILL closes the child's pipe before the child has finished exiting: wait for its exit, bounded
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already gone and reaped
    try:
        exited, _, _ = select.select([pidfd], [], [], 30)
    finally:
        os.close(pidfd)
    assert exited, "the row's child still runs 30 s after its row timed out"


@pytest.mark.parametrize("probe", sorted(p.stem for p in (Path(common.__file__).parent / "probes").glob("*.py")
                                         if p.stem != "__init__"))
def test_each_probe_imports_and_documents_its_command(probe):
    """Probes are run by hand: at least they import against today's code and say how to run them."""
    import importlib

    module = importlib.import_module(f"benchmarks.probes.{probe}")
    assert f"python -m benchmarks.probes.{probe}" in (module.__doc__ or "")
    assert callable(getattr(module, "main", None))


@pytest.mark.parametrize("model", ["amoebanet", "transformer"])
@pytest.mark.parametrize("quick", [False, True])
def test_product_path_config_holds_every_step_in_one_epoch(model, quick):
    """At the configs' own mini-batch (the Transformer's is 1024) the timed rounds never cross an
    epoch boundary."""
    from benchmarks.bench_product_path import compose_config

    cfg = compose_config(model, quick, compiled=False, steps=9)
    assert cfg.trainer.max_steps == 9
    assert cfg.data.num_train // cfg.data.batch_size >= 9


def test_product_path_timer_counts_rounds_across_epochs():
    from benchmarks.bench_product_path import Alternate

    calls = []
    timer = Alternate(calls.append, warmup=2)
    for batch_idx in (0, 1, 0, 1, 0, 1):  # three epochs of two batches
        timer.on_train_batch_start(None, None, batch_idx, batch_idx)
    assert len(calls) == 6
    assert len(timer.product) == len(timer.raw) == 3  # rounds after the 2 warm-up batches

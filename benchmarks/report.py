"""Write one run's results as ``benchmarks.md`` (tables, plots) and ``benchmarks.json``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.bench_yardstick import replay_line  # noqa: E402
from benchmarks.bench_yardstick import table as yardstick_table  # noqa: E402
from gpipe_lab.bench.machine import figure_metadata  # noqa: E402
from gpipe_lab.bench.markdown import md_table  # noqa: E402

MIB = 2**20


def _f(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    return md_table(header, rows, _f).splitlines() + [""]


def _save(fig: plt.Figure, path: Path) -> None:
    """Lay out, save with the commit and command in the PNG's metadata, and close."""
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata=figure_metadata())
    plt.close(fig)


def plot_throughput(results: dict, path: Path) -> None:
    """Speed-up over the 1-thread baseline vs M, per workload and checkpoint mode, with the ideals."""
    local = results["local"]
    fig, axes = plt.subplots(1, len(local), figsize=(5 * len(local), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], local.items()):
        for ck in ("never", "except_last", "always"):
            rows = [r for r in res["rows"] if r["checkpoint"] == ck and r["schedule"] == "gpipe"]
            if rows:
                ax.plot([r["M"] for r in rows], [r["speedup"] for r in rows], "o-", label=f"GPipe {ck}")
        never = [r for r in res["rows"] if r["checkpoint"] == "never" and r["schedule"] == "gpipe"]
        ax.plot([r["M"] for r in never], [r["ideal_uncorrected_speedup"] for r in never], "k--x",
                label="ideal KM/(M+K-1)")
        ax.plot([r["M"] for r in never], [r["baseline_s"] / r["ideal_step_s"] for r in never], "k:+",
                label="ideal, micro-batch corrected")
        # every gloo row carries the baseline timed in its own rounds
        for fw, schedule, style in (("ours", "gpipe", "s-"), ("ours", "gpipe-bw", "v-"), ("torch", "gpipe", "d-")):
            gl = sorted((r["chunks"], r["speedup"]) for r in results.get("gloo", [])
                        if (r["workload"], r["framework"], r["schedule"], r["checkpoint"]) == (name, fw, schedule, "never")
                        and not r.get("error") and r.get("speedup"))
            if gl:
                label = (f"ours {schedule}, distributed (gloo)" if fw == "ours" else "torch ScheduleGPipe (gloo)")
                ax.plot([m for m, _ in gl], [v for _, v in gl], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name} (K=2)")
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("speed-up over 1 thread")
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_bubble(results: dict, path: Path) -> None:
    """Measured bubble vs (K-1)/(M+K-1), never mode."""
    fig, ax = plt.subplots(figsize=(5, 4))
    theory_done = False
    for name, res in results["local"].items():
        rows = [r for r in res["rows"] if r["checkpoint"] == "never" and r["schedule"] == "gpipe"]
        ax.plot([r["M"] for r in rows], [r["bubble_measured"] for r in rows], "o-", label=f"{name} measured")
        if not theory_done:
            ax.plot([r["M"] for r in rows], [r["bubble_theory"] for r in rows], "k--", label="theory")
            theory_done = True
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("bubble")
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_memory(results: dict, path: Path, m: int | None) -> None:
    """MLP stage-0 saved-activation peak per schedule and checkpoint mode, with the model."""
    rows = [r for r in results["memory"].get("mlp", {}).get("activations", []) if r["M"] == m and r["stage"] == 0]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r['schedule']}\n{r['checkpoint']}" for r in rows]
    ax.bar(labels, [r["peak_activation_bytes"] / MIB for r in rows], label="measured")
    ax.scatter([lab for lab, r in zip(labels, rows) if r["model_bytes"]],
               [r["model_bytes"] / MIB for r in rows if r["model_bytes"]], color="k", zorder=3, label="model")
    ax.set_ylabel("MiB saved for backward (stage 0)")
    ax.set_title(f"MLP, K=2, M={m}")
    ax.legend()
    _save(fig, path)


def _yardstick_section(results: dict) -> list[str]:
    rows = results.get("yardstick")
    if not rows:
        return []
    return ["## Against plain PyTorch: gradient accumulation over the same M micro-batches", "",
            yardstick_table(rows), "",
            "Plain: the unpipelined module stepping the M micro-batches in turn, gradients accumulating, one "
            "intra-op thread; the engine: `GPipe.train_step`, `checkpoint=\"never\"`, one thread per stage. "
            "Step times: medians of alternated rounds in one run; each ratio: the median of its two "
            "contenders' per-round ratios (a slow moment of the machine hits both calls of a round). "
            "K=1 / plain is the engine's pure overhead (1.00 is "
            "free); plain / K=2 is what pipelining over two cores gains (cut by FLOPs, the app's default; "
            "*time balance*: cut by each layer's measured forward+backward seconds on one micro-batch, "
            "`pipeline.cost=time`, the cuts in brackets). Replay cost: the step with "
            "`random_replay` at its default over the step with it off, less one (the MLP and AmoebaNet "
            "draw nothing). *K=2 stages alone*: each stage's own F+B of the M micro-batches, no hand-over, "
            "one after the other on one thread; *2-thread scaling*: those two run at once on two threads "
            "against one after the other (2.00 = two free cores); *gain ceiling*: plain / max(S0 + S1/M, "
            "S1 + S0/M) with S0, S1 the stages alone: no schedule of these stages takes less than that "
            "bound (`bench_ceiling.pipeline_lower_bound`), and two stages computing at once only slow "
            "each other.", ""] + ([f"Replay cost where something is drawn: {replay_line(results['replay'])}.", ""]
                                     if results.get("replay") else [])


def _local_section(results: dict) -> list[str]:
    out = ["## Throughput, local transport (K=2 threads, 1 intra-op thread each)", ""]
    for name, res in results["local"].items():
        out += [f"### {name}: baseline (unpipelined, 1 thread) {res['baseline_s']:.4f} s/step; "
                f"balance {res['balance']}; {res['info']}", ""]
        rows = [[r["M"], r["schedule"], r["checkpoint"], r["step_s"], r.get("baseline_s"), r["speedup"],
                 r["ideal_uncorrected_speedup"], r["ideal_step_s"], r["fraction_of_ideal"],
                 r.get("parallel_scaling"), r.get("fraction_of_ceiling"), r["bubble_measured"], r["bubble_theory"]]
                for r in res["rows"]]
        out += _table(["M", "schedule", "checkpoint", "step s (median)", "baseline s (same rounds)", "speed-up",
                       "ideal KM/(M+K-1)", "corrected ideal step s", "fraction of ideal",
                       "machine 2-thread scaling", "fraction of machine ceiling", "bubble", "bubble theory"], rows)
    out += ["Speed-ups divide the baseline step timed in the same rounds as the pipelined one (alternating). "
            "*Machine 2-thread scaling*: the two stages' own work (no hand-over) on two threads vs one after "
            "the other, timed alternately (`bench_ceiling.py`); 2.0 is a perfect machine. *Fraction of machine "
            "ceiling*: (parallel time · (M+K−1)/M) / pipelined step, i.e. how close the engine comes to what "
            "these cores deliver at that moment.", ""]
    return out


def _gloo_section(results: dict) -> list[str]:
    out = ["## Distributed transport vs torch.distributed.pipelining (gloo, 2 processes, 1 thread each)", ""]
    if not results.get("gloo"):
        return out + ["Not run (CUDA device, or `--no-distributed`).", ""]
    rows = [[r["workload"], r["framework"], r["schedule"], r["chunks"], r["checkpoint"],
             r["step"]["median"] if not r.get("error") else None, r.get("baseline_s"), r.get("speedup"),
             r.get("bubble"), _of_bound(r), (r.get("error") or "")[:80]]
            for r in results["gloo"]]
    return out + _table(["workload", "framework", "schedule", "M", "checkpoint", "step s (median)",
                         "baseline s (same rounds)", "speed-up", "bubble", "step / lower bound", "error"], rows) + [
        "The baseline is the whole module on rank 0 (one thread), timed in the same alternating rounds. "
        "*Lower bound*: max(S0 + S1/M, S1 + S0/M), where S0, S1 are the stages' own F+B of the M "
        "micro-batches timed alone on rank 0 in the same rounds (`bench_ceiling.pipeline_lower_bound`): no "
        "schedule doing that work (gpipe, 1f1b) can take less, and two stages computing at once on two cores "
        "only slow each other; gpipe-bw does less (one weight-gradient GEMM per layer over all "
        "micro-batches), so it can go under the bound.", ""]


def _of_bound(row: dict) -> float | None:
    """A gloo row's step over the lower bound of any schedule of its stages (None if unmeasured)."""
    bound = row.get("lower_bound_s")
    return row["step"]["median"] / bound if bound and not row.get("error") else None


def _app_sections(results: dict) -> list[str]:
    """gpipe-train vs the raw engine, and eager vs compiled stages, where the run measured them."""
    out: list[str] = []
    if results.get("product"):
        out += ["## Product path: `gpipe-train` (Lightning + `GPipeStrategy`) vs the raw engine", ""]
        out += _table(["model", "transport", "K", "M", "product step s", "raw step s", "ratio raw / product",
                       "rounds", "command", "error"],
                      [[r["model"], r["transport"], r.get("K"), r.get("M"), r.get("product_step_s"),
                        r.get("raw_step_s"), r.get("ratio"), r.get("rounds"), f"`{r['command']}`",
                        (r.get("error") or "")[:80]] for r in results["product"]])
        out += ["Medians of alternating rounds in one run: each product-path step is timed between two batch "
                "starts less the raw engine's step (`GPipe.train_step` + the optimizer step on a twin model, "
                "or `DistributedGPipe` on the same process group) run at the same batch start.", ""]
    if results.get("compile"):
        out += ["## Compiled stages (`compile=True`) vs eager, K=2, one thread per stage", ""]
        out += _table(["model", "M", "eager step s", "eager, no random replay s", "compiled step s", "speed-up",
                       "speed-up over no replay", "compile s", "command", "error"],
                      [[r["model"], r.get("M"), r.get("eager_step_s"), r.get("eager_no_replay_step_s"),
                        r.get("compiled_step_s"), r.get("speedup"), r.get("speedup_over_no_replay"),
                        r.get("compile_s"), f"`{r['command']}`", (r.get("error") or "")[:80]]
                       for r in results["compile"]])
        out += ["Eager as users get it (`random_replay=True`: every forward op takes the replay hop that "
                "compiled stages skip) and without the hop; compile s: the compiled pipeline's first two "
                "steps less two eager steps, from an empty Inductor cache.", ""]
    return out


def _memory_section(results: dict) -> list[str]:
    out = ["## Memory (deterministic: saved-tensor hooks; model from shapes)", "",
           "Model: `always` ≈ boundary inputs of all M micro-batches + internals of one micro-batch; "
           "`never` (GPipe) ≈ M · (input + internals) of a micro-batch.", ""]
    for name, res in results["memory"].items():
        rows = [[r["M"], r["schedule"], r["checkpoint"], r["stage"], r["peak_activation_bytes"] / MIB,
                 None if r["model_bytes"] is None else r["model_bytes"] / MIB, r["ratio_to_model"]]
                for r in res["activations"]]
        out += [f"### {name}: saved activations (MiB)", ""]
        out += _table(["M", "schedule", "checkpoint", "stage", "measured peak", "model", "measured/model"], rows)
        rows = [[p["stage"], p["parameter_bytes"] / MIB, p["gradient_bytes"] / MIB, p["adam_state_bytes"] / MIB,
                 p["sgd_momentum_state_bytes"] / MIB] for p in res["parameters"]]
        out += [f"### {name}: parameters and optimizer state per stage (MiB)", ""]
        out += _table(["stage", "parameters", "gradients", "Adam state (2x)", "SGD momentum (1x)"], rows)
    return out


def _sections(meta: dict) -> str:
    """The run's wall seconds per section, as `` (local 80 s, yardstick 40 s, ...)``."""
    sections = meta.get("sections_s")
    return " (" + ", ".join(f"{k} {v:.0f} s" for k, v in sections.items()) + ")" if sections else ""


def write_report(results: dict, out: Path, memory_m: int | None) -> None:
    """Write ``benchmarks.json``, ``benchmarks.md`` and the plots under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    plots = out / "benchmarks"
    plots.mkdir(exist_ok=True)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    pictures = []
    if results.get("local"):
        plot_throughput(results, plots / "throughput.png")
        plot_bubble(results, plots / "bubble.png")
        pictures += ["throughput.png", "bubble.png"]
    if results.get("memory", {}).get("mlp"):
        plot_memory(results, plots / "memory.png", memory_m)
        pictures.append("memory.png")
    meta = results["meta"]
    lines = ["# GPipe Lab benchmarks", "",
             f"- date: {meta['date']}, commit `{meta.get('commit', 'unknown')}`", f"- command: `{meta['command']}` (mode {meta['mode']})",
             f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, torch "
             f"{meta['machine']['torch']}, device {meta['machine']['device']}",
             f"- load average before / after: {meta['load_before']} / {meta['load_after']} "
             "(timings are only meaningful when the load is below the core count)",
             f"- wall time of the run: {meta['duration_s']:.0f} s" + _sections(meta), "",
             "## Targets (K=2, this machine)", ""]
    lines += _table(["target", "value", "goal", "status"],
                    [[t["name"], f"{_f(t['value'], 4)} {t['unit']}".strip(), t["goal"], t["status"]]
                     for t in results["targets"]])
    if results.get("notes"):
        lines += ["## What limits the missed targets", ""] + [f"- {n}" for n in results["notes"]] + [""]
    lines += [f"![{p}](benchmarks/{p})" for p in pictures] + [""]
    lines += _yardstick_section(results)
    lines += _local_section(results)
    ov = results.get("overhead")
    if ov:
        lines += ["## Scheduling overhead (4 × Linear(4,4), K=2)", ""]
        lines += _table(["M", "actions", "step s", "unpipelined compute s", "overhead / action µs",
                         "same with memory counting µs", "same, counting every forward µs",
                         "same with random_replay=False µs",
                         "replay guard's share of the step", "time inside an action µs",
                         "per critical-path tick µs"],
                        [[ov["microbatches"], ov["actions"], ov["step_s"], ov["compute_s"],
                          ov["overhead_per_action_us"], ov.get("overhead_with_memory_tracking_us", float("nan")),
                          ov.get("overhead_counting_every_forward_us", float("nan")),
                          ov.get("overhead_without_replay_us", float("nan")), ov.get("replay_guard_share", float("nan")),
                          ov["inside_action_us"], ov["per_tick_us"]]])
    lines += _gloo_section(results)
    lines += _app_sections(results)
    lines += _memory_section(results)
    (out / "benchmarks.md").write_text("\n".join(lines) + "\n", encoding="utf-8")

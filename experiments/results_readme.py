"""Write ``results/README.md`` from the files of ``results/``: every figure in it is computed from them.

    python -m experiments.results_readme                 # rewrite results/README.md
    python -m experiments.results_readme --check         # exit 1 if the committed file is not what this writes

The prose is a template; each number, verdict and finding is read or computed from the JSON and markdown
files the experiment scripts wrote (``experiments.results_claims`` judges the paper's claims), so the file
is generated like every other file of ``results/`` and is never edited by hand. It names no date or
commit of its own: running it twice on the same files writes the same bytes. ``python -m
experiments.regenerate`` runs it as its last job.

Raises (exit status 1 with ``--check``): the file on disk differs from what the files give.
"""

from __future__ import annotations

if not __package__:  # started as a file: rerun as the module
    from gpipe_lab.bench.script_launch import rerun_as_module

    rerun_as_module(__file__)

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from experiments.results_claims import (
    CLAIMS,
    KS,
    MS,
    NEAR_LINEAR,
    RULE_VALUES,
    WORKLOADS,
    contrasts,
    sweep_jobs,
    sweep_normalized,
    table2_normalized,
    table2_paper,
)
from experiments.results_files import SEEDS_NEEDED, Results, arm, mean, number, printed_unit, row_of
from gpipe_lab.bench.markdown import md_table

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: this job's own name in ``regeneration.json`` (left out of the table it writes, so a rerun gives the same file)
JOB = "results_readme"


def one_line(doc: str | None) -> str:
    """A rule's docstring as one markdown line: thresholds by their values, ``code`` as `code`."""
    text = re.sub(r"``(\w+)``", lambda m: RULE_VALUES.get(m.group(1), f"`{m.group(1)}`"), " ".join((doc or "").split()))
    return text.replace("``", "`")


def f(value: float | None, digits: int = 2) -> str:
    """A number for a table cell ('-' when missing)."""
    return "-" if value is None else f"{value:.{digits}f}"


def reviewer(res: Results) -> list[str]:
    """The reviewer's table: each claim, its verdict, the reason, the files and the rule."""
    rows = []
    for claim, (files, judge) in CLAIMS.items():
        v = judge(res)
        rows.append([claim, f"**{v.verdict}**", v.reason, files])
    rules = [f"- *{claim}*: {one_line(judge.__doc__)}" for claim, (_, judge) in CLAIMS.items()]
    return ["## The paper's claims, judged from these files", "",
            "Each verdict and reason is computed by `experiments/results_claims.py` from the files named; the rule "
            "of each row follows the table.", "",
            md_table(["paper claim", "verdict", "why (computed)", "files"], rows), "", "Rules:", "", *rules, ""]


def runs(res: Results) -> list[str]:
    """What was run, when, at which commit and load (``regeneration.json``)."""
    records = sorted((r for r in res.json("regeneration.json") if r["job"] != JOB), key=lambda r: r["started"])
    commits = sorted({r["commit"] for r in records})
    rows = [[r["job"], "; ".join(f"`{c}`" for c in r["commands"]), f"`{r['commit']}`", r["started"],
             f"{r['seconds']:.0f}", f"{r['load_before'][0]:.2f} → {r['load_after'][0]:.2f}", r["exit_status"]]
            for r in records]
    first = records[0] if records else None
    lines = ["## What was run, when", "",
             "`python -m experiments.regenerate` runs each job's commands one after the other from a clean checkout "
             "and records each job in `regeneration.json`; this table is that file (the load is the one-minute "
             "load average before and after the job; two cores).", ""]
    if first:
        lines += [f"Jobs recorded: {len(records)}, at source commit(s) {', '.join(f'`{c}`' for c in commits)}, "
                  f"from {first['started']} to {records[-1]['started']} (start of the last). The load average "
                  f"before the first job was {first['load_before'][0]:.2f}; other processes may have run beside "
                  "any job (the load is all this file can tell).", ""]
    return lines + [md_table(["job", "commands", "commit", "started", "wall s", "load before → after", "exit"], rows), ""]


def table2(res: Results) -> list[str]:
    """Table 2 beside the paper, K = 2, 4, 8 and M = 1, 4, 32; the contrast in K; why CPU stages cannot show it."""
    paper, ours = table2_paper(res), table2_normalized(res)
    cells = sweep_jobs(res)
    jobs = sweep_normalized(cells)
    rows = []
    for w in WORKLOADS:
        for m in MS:
            for k in KS:
                sweep = arm(jobs[(w, k, m)]) if k == 2 and (w, k, m) in jobs else "-"
                rows.append([WORKLOADS[w], m, k, f(paper.get((w, k, m))), f(ours.get(("emulated", w, k, m))),
                             f(ours.get(("simulated", w, k, m))),
                             f(ours.get(("measured", w, k, m))) if k == 2 else "- (two cores)", sweep])
    lines = ["## Table 2 beside the paper", "",
             "Normalized throughput (K=2, M=1 = 1 in each column). Paper: TPU, AmoebaNet-D(18, 256) and "
             "Transformer-48 (the paper column of `table2_throughput.md`). Emulated and simulated: "
             "`table2_throughput.json` (emulated devices sleep each layer's FLOPs share: the engine's mechanics, "
             "not hardware). Measured: real CPU stages, K=2 only (one core per stage), from the engine script "
             "(`table2_throughput.json`) and from `gpipe-train` sweeps (`sweeps/table2_throughput.json`, each job "
             "over its model's mean K=2, M=1). The two measured columns run different analogues (each file's first "
             "lines name its model and mini-batch).", "",
             md_table(["model", "M", "K", "paper", "emulated", "simulated", "measured, engine script",
                       "measured, gpipe-train jobs"], rows), ""]
    lines += ["**The paper's contrast** (the Transformer near-linear in K, AmoebaNet not). Rule: a model is "
              f"near-linear when K=2 → 8 at M=32 gains at least {NEAR_LINEAR:.0%} of the 4× that K grows; the "
              "contrast is shown when the Transformer is and AmoebaNet is not.", ""]
    crows = [[source, *(f(eff[w]) for w in WORKLOADS), verdict] for source, (eff, verdict) in contrasts(res).items()]
    lines += [md_table(["source", *(f"{WORKLOADS[w]}: K=8 / K=2 / 4 at M=32" for w in WORKLOADS), "contrast"], crows),
              ""]
    lines += microbatch_cost(res, jobs)
    return lines


def microbatch_cost(res: Results, jobs: dict[tuple[str, int, int], list[float]]) -> list[str]:
    """Why real CPU stages cannot show the trend: ``sweeps/microbatch_cost.json``'s per-sample cost and bound."""
    rows = res.json("sweeps/microbatch_cost.json")["rows"]
    lines = ["**Why real CPU stages cannot show it.** K = 4, 8 need more cores than this machine has, and at K=2 "
             "the trend in M needs a small micro-batch to cost no more per sample than a large one. "
             "`sweeps/microbatch_cost.json` times the unpipelined model on one thread at each M (re-materializing "
             "M−1 micro-batches, Table 2's setting) and bounds K=2 from it:", ""]
    for r in rows:
        if r["checkpoint"] != "except_last" or r["M"] == 1:
            continue
        w = r["model"]
        sweep = jobs.get((w, 2, r["M"]))
        reached = (f"; the sweep's K=2, M={r['M']} reaches {mean(sweep):.4f}, {mean(sweep) / r['k2_most_vs_M1']:.2f} "
                   "of that bound") if sweep else ""
        lines.append(f"- {WORKLOADS.get(w, w)}, M={r['M']}: per-sample speed {r['vs_M1']:.2f} of M=1, i.e. a sample "
                     f"costs {1 / r['vs_M1']:.2f}× as much; K=2 can reach at most {r['k2_most_vs_M1']:.4f} of K=2, "
                     f"M=1{reached} (runs per cell: {r['runs']}).")
    return lines + [""]


def speedups(res: Results) -> list[str]:
    """Both speed-up baselines, labelled, and which one a reader should take."""
    bench = res.json("benchmarks.json")
    lines = ["## Speed-ups: against what", "",
             "Two baselines appear in these files; they answer different questions.", "",
             "1. **Plain PyTorch on one thread vs K=2 on two cores** (`benchmarks.md`, \"plain / K=2 (gain)\": "
             "gradient accumulation over the same M micro-batches, one intra-op thread, divided by the engine at "
             "K=2, one thread per stage). It shows what pipelining adds over one core; it doubles the cores:"]
    for y in bench["yardstick"]:
        lines.append(f"   - {y['workload']}, batch {y['batch']}, M={y['M']}: {y['gain']['K=2']:.3f}× "
                     f"({y['rounds']} alternating rounds)")
    lines += ["2. **Plain PyTorch on both cores over the whole batch vs K=2** (the `gpipe-train` sweeps: K=1, M=1 "
              "jobs with as many intra-op threads as K=2's two stages, against K=2 at each M; each K=2 job over the "
              "mean of the K=1, M=1 jobs). This is what a user of this machine would run instead:", ""]
    rows = []
    for name, label in (("sweeps/table2_throughput.json", "eager"), ("sweeps/compiled/table2_throughput.json", "compiled")):
        cells = sweep_jobs(res, name) if res.exists(name) else {}
        for w in WORKLOADS:
            if (w, 1, 1) in cells:
                base = mean(cells[(w, 1, 1)])
                rows += [[WORKLOADS[w], label, arm(cells[(w, 1, 1)], 1), m, arm(v / base for v in cells[(w, 2, m)])]
                         for m in MS if (w, 2, m) in cells]
    lines.append(md_table(["model", "stages", "K=1, M=1 samples/s", "M", "K=2 / K=1, M=1"], rows))
    return lines + ["", "Take the second: it compares the same two cores used two ways. The first credits "
                    "pipelining with the second core.", ""]


def arms(res: Results) -> list[str]:
    """Every two-arm comparison with mean, range and run count; the final losses of the sweeps across K."""
    cells = sweep_jobs(res)
    runs = sorted({len(v) for v in cells.values()})
    times = f"{runs[0]}" if len(runs) == 1 else f"{runs[0]} to {runs[-1]}"
    lines = ["## Two arms compared (mean [min, max] (n) per arm)", "",
             f"⚠ marks an arm with fewer than {SEEDS_NEEDED} runs: a difference there is not established. "
             f"The eager sweeps ran each cell {times} times "
             "(`sweeps/table2_throughput.json`).", ""]
    rows = [[WORKLOADS[w], m, arm(cells[(w, 1, m)], 1), arm(cells[(w, 2, m)], 1)]
            for w in WORKLOADS for m in MS if (w, 1, m) in cells and (w, 2, m) in cells]
    lines += ["K=1 against K=2, samples/s, `gpipe-train` eager (`sweeps/table2_throughput.json`):", "",
              md_table(["model", "M", "K=1", "K=2"], rows), ""]
    if res.exists("sweeps/compiled/table2_throughput.json"):
        compiled = sweep_jobs(res, "sweeps/compiled/table2_throughput.json")
        rows = [[WORKLOADS[w], k, m, arm(cells[(w, k, m)], 1), arm(compiled[(w, k, m)], 1)]
                for (w, k, m) in sorted(compiled) if (w, k, m) in cells]
        lines += ["Eager against compiled stages, samples/s (`sweeps/compiled/table2_throughput.json`):", "",
                  md_table(["model", "K", "M", "eager", "compiled"], rows), ""]
    nmt = res.json("nmt_scaling.json")
    transfer = res.json("transfer.json")["runs"]
    lines += [f"- Depth vs width (`nmt_scaling.json`), validation NLL: deep {arm(r['val_nll'] for r in nmt['depth']['deep'])}"
              f", wide {arm(r['val_nll'] for r in nmt['depth']['wide'])}.",
              "- Tokens per batch (`nmt_scaling.json`), validation NLL: " + "; ".join(
                  f"batch {b}: {arm(r['val_nll'] for r in nmt['batch'][b])}" for b in sorted(nmt["batch"], key=int)) + ".",
              f"- Transfer (`transfer.json`), top-1 %: pretrained {arm((r['pretrained'] for r in transfer), 1)}, scratch "
              f"{arm((r['scratch'] for r in transfer), 1)}.", ""]
    return lines + final_losses(res)


def final_losses(res: Results) -> list[str]:
    """Whether the sweeps' repeated jobs end at the same losses at K=1 and K=2 (per model and M)."""
    losses: dict[tuple[str, int, int], list[float]] = {}
    for r in res.json("sweeps/table2_throughput.json")["rows"]:
        losses.setdefault((r["workload"], r["K"], r["M"]), []).append(r["final_train_loss"])
    lines = ["**Final training losses at K=1 and K=2** (`sweeps/table2_throughput.json`, the same seeds in each cell):", ""]
    for w in WORKLOADS:
        for m in MS:
            a, b = sorted(losses.get((w, 1, m), [])), sorted(losses.get((w, 2, m), []))
            if not a or not b:
                continue
            gap = max(abs(x - y) for x, y in zip(a, b))
            same = "the same" if gap < 1e-4 else "different"
            lines.append(f"- {WORKLOADS[w]}, M={m}: {same} (K=1 {', '.join(f'{x:.2f}' for x in a)}; K=2 "
                         f"{', '.join(f'{x:.2f}' for x in b)}; largest gap {gap:.4f}).")
    return lines + [""]


def spread(res: Results) -> list[str]:
    """Run-to-run spread of the wall-clock tables."""
    t2 = {(r["workload"], r["K"], r["M"]): r["measured_s"] for r in res.json("table2_throughput.json")["rows"]
          if r.get("measured_s")}
    rows = []
    for r in res.json("overheads.json")["rows"]:
        key = (r["workload"], r["K"], r["M"])
        if key in t2:
            a, b = t2[key], r["wall_s"]
            rows.append([WORKLOADS.get(key[0], key[0]), key[1], key[2], f"{a:.3f}", f"{b:.3f}", f"{max(a, b) / min(a, b) - 1:.0%}"])
    cells = sweep_jobs(res)
    rel = sorted((max(v) - min(v)) / mean(v) for v in cells.values() if len(v) > 1)
    scaling = sorted(_find(res.json("benchmarks.json"), "parallel_scaling") +
                     (_find(res.json("full/benchmarks.json"), "parallel_scaling") if res.exists("full/benchmarks.json") else []))
    lines = ["## Wall-clock spread", "",
             "The same step timed by two scripts minutes apart (`table2_throughput.json` measured, "
             "`overheads.json` wall):", "",
             md_table(["model", "K", "M", "table2 s/step", "overheads s/step", "spread"], rows), ""]
    if rel:
        lines.append(f"- The sweeps' repeated jobs of one cell (`sweeps/table2_throughput.json`, {len(rel)} cells): "
                     f"(max − min) / mean from {rel[0]:.0%} to {rel[-1]:.0%}, median {rel[len(rel) // 2]:.0%}.")
    if scaling:
        lines.append(f"- The two cores' delivered scaling (\"2-thread scaling\", the same work on two threads against one "
                     f"after the other; 2.00 = two free cores) in `benchmarks.json` and `full/benchmarks.json`: "
                     f"{scaling[0]:.2f}–{scaling[-1]:.2f} over {len(scaling)} measurements.")
    return lines + ["- So a ratio of two wall-clock cells is worth quoting only beyond these spreads.", ""]


def _find(data: Any, key: str) -> list[float]:
    """Every number stored under ``key`` anywhere in a JSON tree."""
    if isinstance(data, dict):
        return [v for k, v in data.items() if k == key and isinstance(v, (int, float))] + \
            [x for v in data.values() for x in _find(v, key)]
    if isinstance(data, list):
        return [x for v in data for x in _find(v, key)]
    return []


def table1(res: Results) -> list[str]:
    """Table 1's parameter counts at the paper's printed precision, and the Naive-1 activation memory."""
    t1 = res.json("table1_capacity.json")
    lines = ["## Table 1 (`table1_capacity.json`)", "",
             "Parameter counts against the paper's printed figures (the paper's Table 1, as `table1_capacity.json` "
             "copies it): a count *rounds to* the paper's when it equals it at the paper's last printed digit.", ""]
    rows = []
    for model in ("amoebanet", "transformer"):
        head = t1[model][0]
        paper, ours = row_of(t1[model], "paper # params"), row_of(t1[model], "ours # params (exact count)")
        for col, p, o in zip(head[1:], paper[1:], ours[1:]):
            unit, exact = printed_unit(p), float(number(o) or 0)
            rounds = round(exact / unit) * unit == round(float(number(p) or 0) / unit) * unit
            rows.append([model, col, p, o, "yes" if rounds else "no", f"{exact / float(number(p) or 1) - 1:+.2%}"])
    lines += [md_table(["model", "column", "paper", "ours (exact)", "rounds to the paper's", "ours / paper − 1"], rows), ""]
    act, paper_act = row_of(t1["amoebanet"], "ours peak activation, sum (max/stage)")[1], \
        row_of(t1["amoebanet"], "paper peak activation")[1]
    gib, gb = float(number(act) or 0), float(number(paper_act) or 0)
    lines += [f"AmoebaNet Naive-1 peak activations: ours {act.split()[0]} (GiB, eager autograd in float32) = "
              f"{gib * 2 ** 30 / 1e9:.1f} GB, {gib * 2 ** 30 / 1e9 / gb:.1f}× the paper's {paper_act}.", ""]
    return lines


#: file: which of its bullets to quote (a regular expression matched at the start)
FINDINGS = {"table2_throughput.md": "Simulator", "table3_throughput.md": "Simulator", "overheads.md": "",
            "simulator_heldout.md": "", "nmt_scaling.md": "", "benchmarks.md": r"(?!date|command|machine|load|wall)",
            "full/benchmarks.md": r"(?!date|command|machine|load|wall)", "plan_check.md": ""}


def findings(res: Results) -> list[str]:
    """Each generated file's own findings (its bullet lines), and a few figures computed from the JSON files."""
    lines = ["## What each file finds", "",
             "The bullets each script printed under its tables (quoted; the file has the rest).", ""]
    for name, keep in FINDINGS.items():
        found = [b for b in res.bullets(name) if re.match(keep, b)]
        if found:
            lines += [f"[{name}]({name}):", "", *(f"- {b}" for b in found[:4])]
            lines += [f"- ({len(found) - 4} more in the file)"] if len(found) > 4 else []
            lines.append("")
    for name in ("benchmarks.json", "full/benchmarks.json"):
        if res.exists(name):
            b = res.json(name)
            passed = sum(t["status"] == "PASS" for t in b["targets"])
            product = "; ".join(f"{p['model']} ({p['transport']}) {p['ratio']:.3f}" for p in b.get("product", []))
            lines += [f"[{name}]({name}): {passed} of {len(b['targets'])} targets pass in this one run (`{b['meta']['command']}`)"
                      + (f"; raw engine step / `gpipe-train` step, median of alternating rounds: {product}" if product else "")
                      + ".", ""]
    e = res.json("emulated_scaling.json")
    lines += [f"[emulated_scaling.md](emulated_scaling.md): K={e['K']}, M={e['M']} on {e['layers']} equal emulated "
              f"layers runs {e['speedup']:.2f}× the K=1, M={e['M']} step against K·M/(M+K−1) = {e['ideal']:.2f} "
              f"({e['gap']:+.1%}); {e['speedup_vs_plain']:.2f}× the unpipelined step without re-materialization; "
              f"measured bubble {e['bubble']:.3f} against theory {e['bubble_theory']:.3f}.", ""]
    sched = res.json("schedules/schedules.json")["rows"]
    worst = max(sched, key=lambda r: abs(r["replayed_over_measured"] - 1))
    ms = sorted({r["chunks"] for r in sched})
    lines += [f"[schedules/](schedules/): each step replayed from its own action durations is within "
              f"{abs(worst['replayed_over_measured'] - 1):.2%} of the measured step at M = {ms[0]}–{ms[-1]} "
              f"(largest gap: {worst['schedule']} at M={worst['chunks']}, replay / measured "
              f"{worst['replayed_over_measured']:.4f}).", ""]
    plan = [r for r in res.json("regeneration.json") if r["job"] == "plan_check"]
    if plan:
        written = res.json("plan_check.json")["meta"]["load_average"][0]
        lines += [f"[plan_check.md](plan_check.md): one run; load average {plan[0]['load_before'][0]:.2f} when its job "
                  f"started, {written:.2f} when the file was written.", ""]
    if res.exists("full/benchmarks.json"):
        rows = [[c["model"], c.get("K", "—"), c.get("M", "—"), "—", "—", "—", "—", f"⚠ {c['error']}", f"`{c['command']}`"]
                if "error" in c else
                [c["model"], c["K"], c["M"], f"{c['eager_step_s']:.3f}", f"{c['eager_no_replay_step_s']:.3f}",
                 f"{c['compiled_step_s']:.3f}", f"{c['speedup']:.3f}", f"{c['compile_s']:.0f}", f"`{c['command']}`"]
                for c in res.json("full/benchmarks.json").get("compile", [])]
        if rows:
            lines += ["Compiled stages (`full/benchmarks.json`):", "",
                      md_table(["model", "K", "M", "eager s", "eager, no replay s", "compiled s", "eager / compiled",
                                "compile s", "command"], rows), ""]
    return lines


def differential(res: Results) -> list[str]:
    """``results/differential/``: what it is, its engine digest and count, read from its summary and shards."""
    folder = res.root / "differential"
    if not folder.exists():
        return []
    shards = sorted(p.name for p in folder.glob("shard-*.jsonl"))
    splits: dict[str, int] = {}
    for name in shards:
        m = re.match(r"shard-\d+-of-(\d+)\.jsonl$", name)
        if m:
            splits[m.group(1)] = splits.get(m.group(1), 0) + 1
    summary = res.text("differential/summary.md")
    digests = re.findall(r"engine ([0-9a-f]{7,40})", summary)
    lines = ["## `differential/`: the engine against the unpipelined model over the full product", "",
             "Logs of the differential harness (`tests/engine/differential_full.py`): each line a chunk of cases of "
             "the full product of settings, judged against the unpipelined model (passed cases as index ranges, "
             "failed ones with their recipe). " + (f"Engine digest counted: `{digests[0]}`. " if digests else "") +
             f"Shard files: {len(shards)}, in {len(splits)} split(s) ("
             + ", ".join(f"{n} of {k}" for k, n in sorted(splits.items(), key=lambda kv: int(kv[0]))) + ").", ""]
    said = [line[2:].strip() for line in summary.splitlines() if line.startswith("- ")]
    if said:
        lines += ["`differential/summary.md` states:", "", *(f"- {s}" for s in said), ""]
    return lines


def gpu(res: Results) -> list[str]:
    """The GPU runs: each file's commit, device and the sections that passed and failed."""
    files = [n for n in ("gpu_check.json",) if res.exists(n)] + \
        sorted(f"gpu_runs/{p.name}" for p in (res.root / "gpu_runs").glob("gpu_check_*.json"))
    rows = []
    for name in files:
        g = res.json(name)
        status = {k: v.get("status") for k, v in g.get("sections", {}).items() if isinstance(v, dict)}
        failed = sorted(k for k, v in status.items() if v == "FAIL")
        rows.append([f"[{name}]({name})", f"`{g.get('commit', '?')}`", g.get("date", "?"), g.get("device", "?"),
                     sum(v == "PASS" for v in status.values()), ", ".join(failed) or "none"])
    probes = sorted(f"gpu_runs/{p.name}" for p in (res.root / "gpu_runs").glob("*.txt"))
    lines = ["## On a GPU", "",
             "`benchmarks/gpu_check.py` runs made on a lent GPU at the commits they name; they cannot be regenerated "
             "on this machine.", "", md_table(["file", "commit", "date", "device", "sections passed", "failed"], rows), ""]
    if probes:
        lines += ["Probe outputs kept beside them: " + ", ".join(f"[{p}]({p})" for p in probes) + ".", ""]
    return lines


HOW = """## How the files are made

*Measured* cells time the real engine on CPU stages (one core each, so K <= 2 here). *Emulated* cells run the
real engine on layers that sleep their share of the FLOPs: they time the engine's own mechanics (schedule,
hand-overs, bubble) at any K, not hardware. *Simulated* cells come from the planner's cost model fitted to the
same run's per-layer CPU times. *Copied* cells are the paper's, as each script prints them.

Each table is written by one script in `experiments/` (`python -m experiments.<name>`; each also takes `--tiny`
for a seconds-long smoke run, `--out DIR` and `--wandb`); the scripts compose their Hydra `experiment=` configs in
`conf/experiment/paper_*.yaml`, and any `key=value` overrides them. Every file names, in its first lines, the date,
the source commit, the machine, torch and the command that wrote it. `python -m experiments.check_results <name>`
reruns a table into a temporary folder and diffs its deterministic columns against this folder.
"""


def document(res: Results) -> str:
    """The whole of ``results/README.md``."""
    parts: list[Iterable[str]] = [
        ["# Reproducing the GPipe paper: results", "",
         "Generated by `python -m experiments.results_readme` from the files of this folder (the last job of "
         "`python -m experiments.regenerate`); do not edit it: `tests/experiments/test_results_readme.py` "
         "regenerates it and fails on any difference.", ""],
        reviewer(res), runs(res), table2(res), speedups(res), arms(res), spread(res), table1(res), findings(res),
        differential(res), gpu(res), [HOW]]
    return "\n".join(line for part in parts for line in part).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the README; the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder of result files (results/)")
    p.add_argument("--out", type=Path, help="where to write (default: README.md in --results)")
    p.add_argument("--check", action="store_true", help="compare with the file instead of writing; exit 1 if it differs")
    args = p.parse_args(argv)
    out = args.out or args.results / "README.md"
    text = document(Results(args.results))
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out}: {'as generated' if same else 'differs from what the files give; rerun python -m experiments.results_readme'}")
        return 0 if same else 1
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a GPU sat idle in a step: device gaps of a ``torch.profiler`` Chrome trace, with the kernels around them.

    python -m benchmarks.trace_gaps TRACE.json.gz   # e.g. gpu_diagnose_threads's trace_K1.json.gz
    python -m benchmarks.trace_gaps TRACE --min-gap-ms 0.5 --top 12

Reads the trace's device events (kernels, copies, memsets), prints the kernel time
per stream, the top kernels by total time, and every stretch of at least
``--min-gap-ms`` in which no device event ran, with the last kernel before it and
the first after it. Needs no GPU: it reads a file written on one
(``export_chrome_trace``), plain or gzipped (``.gz``).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's complete device events, by start time.

    Raises:
        ValueError: the trace holds no device event (a CPU-only trace).
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    found = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                   key=lambda e: e["ts"])
    if not found:
        raise ValueError(f"no device events (categories {DEVICE_CATEGORIES}) in the trace")
    return found


def gaps(events: list[dict[str, Any]], min_gap_us: float) -> list[tuple[float, float, str, str]]:
    """``(start_us, length_us, kernel before, kernel after)`` of each idle stretch >= ``min_gap_us``,
    times from the first device event."""
    origin, busy_until, last_name = events[0]["ts"], events[0]["ts"], ""
    out = []
    for e in events:
        if e["ts"] - busy_until >= min_gap_us:
            out.append((busy_until - origin, e["ts"] - busy_until, last_name, e["name"]))
        if e["ts"] + e["dur"] >= busy_until:
            busy_until, last_name = e["ts"] + e["dur"], e["name"]
    return out


def report(trace: dict[str, Any] | list[dict[str, Any]], min_gap_ms: float = 0.5, top: int = 10) -> str:
    """The text this script prints for ``trace``."""
    events = device_events(trace)
    span = max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]
    per_stream: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        per_stream[str(e.get("args", {}).get("stream"))] += e["dur"]
        per_kernel[e["name"][:90]][0] += e["dur"]
        per_kernel[e["name"][:90]][1] += 1
    busy = sum(per_stream.values())
    lines = [f"device events: {len(events)}, span {span / 1e3:.2f} ms, busy (summed over streams) {busy / 1e3:.2f} ms",
             "busy per stream (ms): " + ", ".join(f"{s}: {t / 1e3:.2f}" for s, t in sorted(per_stream.items())),
             f"top {top} kernels by total time:"]
    for name, (total, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {total / 1e3:8.2f} ms x{int(count):4d}  {name}")
    found = gaps(events, min_gap_ms * 1e3)
    lines.append(f"idle stretches of at least {min_gap_ms} ms: {len(found)}, "
                 f"{sum(g[1] for g in found) / 1e3:.2f} ms in all")
    for start, length, before, after in found:
        lines.append(f"  at {start / 1e3:8.2f} ms: {length / 1e3:7.2f} ms idle; before: {before[:60]}; "
                     f"after: {after[:60]}")
    return "\n".join(lines)


def read_trace(path: Path) -> Any:
    """A Chrome trace file's JSON, gunzipped when its name ends in ``.gz``."""
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a Chrome trace written by torch.profiler on a GPU")
    p.add_argument("--min-gap-ms", type=float, default=0.5, help="the shortest idle stretch listed")
    p.add_argument("--top", type=int, default=10, help="how many kernels to list by total time")
    args = p.parse_args(argv)
    print(f"python -m benchmarks.trace_gaps {args.trace} --min-gap-ms {args.min_gap_ms} --top {args.top}")
    print(report(read_trace(args.trace), args.min_gap_ms, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

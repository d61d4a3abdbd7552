"""Read an offline wandb run (``run-<id>.wandb``) back without the wandb service.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0),
then 32 KiB blocks of records, each with a ``<IHB`` header (crc32, length, type:
FULL=1, FIRST=2, MIDDLE=3, LAST=4). A record's payload is a serialized
``wandb.proto.wandb_internal_pb2.Record``: history rows in ``record.history.item``,
summary updates in ``record.summary.update``, the config in ``record.config.update``.

    run = read_run(find_run_files("logs/train/runs/<date>")[0])
    run.history[-1]["train/loss"]; run.summary["validation_value"]

From the command line (a user tool to check an offline run before ``wandb sync``)::

    python -m gpipe_lab.app.wandb_reader logs/train/runs/<date>            # summary and the loss per step
    python -m gpipe_lab.app.wandb_reader logs/train/runs/<date> --key perf/samples_per_s
    python -m gpipe_lab.app.wandb_reader logs/train/runs/<date> --json     # config, summary, every row
"""

from __future__ import annotations

import argparse
import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER_BYTES = 7
BLOCK_BYTES = 32 * 1024
RECORD_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def find_run_files(directory: str | Path) -> list[Path]:
    """Every ``*.wandb`` file under ``directory`` (sorted)."""
    return sorted(Path(directory).rglob("*.wandb"))


def iter_payloads(path: str | Path) -> Iterator[bytes]:
    """The reassembled payloads of the log, in order.

    Raises:
        ValueError: the file does not start with the wandb header, or a record is cut.
    """
    data = Path(path).read_bytes()
    if len(data) < HEADER_BYTES or data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb log (header {data[:HEADER_BYTES]!r})")
    pos = HEADER_BYTES
    pending = b""
    while pos + RECORD_HEADER.size <= len(data):
        left_in_block = BLOCK_BYTES - pos % BLOCK_BYTES
        if left_in_block < RECORD_HEADER.size:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        pos += RECORD_HEADER.size
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += BLOCK_BYTES - pos % BLOCK_BYTES if pos % BLOCK_BYTES else 0
            continue
        if pos + length > len(data):
            raise ValueError(f"{path}: record at byte {pos} is cut (needs {length} bytes)")
        chunk = data[pos:pos + length]
        pos += length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def _value(item: Any) -> Any:
    raw = item.value_json
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return raw


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if len(item.nested_key) else item.key


@dataclass
class WandbRun:
    """What an offline run recorded: history rows, summary, config, name, group, record kinds seen."""

    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    name: str = ""
    group: str = ""

    def metric(self, key: str) -> list[Any]:
        """Every history value of ``key``, in step order."""
        return [row[key] for row in self.history if key in row]


def _payloads_before_any_cut(path: str | Path) -> Iterator[bytes]:
    try:
        yield from iter_payloads(path)
    except ValueError:  # a run killed while writing ends with a cut record: what came before stands
        return


def read_run(path: str | Path, cut_end: bool = False) -> WandbRun:
    """Parse one ``.wandb`` file into a ``WandbRun``; ``cut_end``: a file whose last record is cut
    (its process was killed) gives the records before it.

    Raises:
        ValueError: not a wandb log, or (without ``cut_end``) a record is cut.
    """
    from wandb.proto import wandb_internal_pb2

    run = WandbRun()
    for payload in (_payloads_before_any_cut(path) if cut_end else iter_payloads(path)):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # protobuf-generated: its stub declares no messages
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type") or "unknown"
        run.kinds[kind] = run.kinds.get(kind, 0) + 1
        if kind == "history":
            run.history.append({_key(item): _value(item) for item in record.history.item})
        elif kind == "summary":
            run.summary.update({_key(item): _value(item) for item in record.summary.update})
        elif kind == "config":
            run.config.update({_key(item): _value(item) for item in record.config.update})
        elif kind == "run":  # the config given to wandb.init, and the run's name and group
            run.config.update({_key(item): _value(item) for item in record.run.config.update})
            run.name, run.group = record.run.display_name, record.run.run_group
        elif kind == "files":
            run.files += [f.path for f in record.files.files]
    return run


def branch_point(run: WandbRun) -> tuple[str, int] | None:
    """``(run id, step)`` when ``run`` resumes a run rewound to that step (``wandb.init(resume_from=...)``):
    once synced, the history is the earlier run's rows up to ``step``, then this run's."""
    point = run.config.get("_wandb", {}).get("branch_point") if isinstance(run.config.get("_wandb"), dict) else None
    return (str(point["run_id"]), int(point["step"])) if point else None


def synced_history(runs: Sequence[WandbRun]) -> list[dict[str, Any]]:
    """The history wandb shows for the runs (in time order) of one run id once they are synced:
    each run that resumes from a branch point first drops the rows after that step."""
    history: list[dict[str, Any]] = []
    for run in runs:
        point = branch_point(run)
        if point is not None:
            history = [row for row in history if row.get("_step", 0) <= point[1]]
        history += run.history
    return history


#: Characters of the text plot, lowest to highest.
BARS = "▁▂▃▄▅▆▇█"


#: The history key holding the training step (Lightning's ``WandbLogger`` adds it to every row it logs);
#: ``_step`` is wandb's own row counter.
STEP_KEY = "trainer/global_step"


def history_lines(run: WandbRun, key: str, rows: int = 20) -> list[str]:
    """``key`` per training step as text: a one-line plot of every value, then up to ``rows`` rows
    (evenly spaced, the first and the last included), each labelled with the row's training step
    (``trainer/global_step``; wandb's ``_step`` only for a row without one)."""
    points = [(row.get(STEP_KEY, row.get("_step", i)), row[key]) for i, row in enumerate(run.history)
              if isinstance(row.get(key), (int, float))]
    if not points:
        return [f"{key}: not in the history (keys: {', '.join(sorted({k for r in run.history for k in r}))})"]
    values = [v for _, v in points]
    low, high = min(values), max(values)
    scale = (len(BARS) - 1) / (high - low) if high > low else 0.0
    plot = "".join(BARS[round((v - low) * scale)] for v in values)
    lines = [f"{key} over {len(points)} logged steps (min {low:.4g}, max {high:.4g}):", f"  {plot}"]
    shown = min(rows, len(points))
    picks = sorted({round(i * (len(points) - 1) / max(1, shown - 1)) for i in range(shown)})
    lines += [f"  step {points[i][0]:>6}  {points[i][1]:.4g}" for i in picks]
    return lines


def resume_note(run: WandbRun) -> str:
    """How ``run`` continues an earlier run: the training step of the checkpoint it resumed
    (``resumed_from_step`` in its config); empty for a run that resumes nothing."""
    point = branch_point(run)
    if point is None:
        return ""
    step = run.config.get("resumed_from_step")
    where = f"its checkpoint at training step {step}" if step is not None else f"wandb row _step={point[1]}"
    return f", resumes run {point[0]} from {where}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print each offline run under a folder: its name, summary and one history key per step
    (a text plot and rows), or with ``--json`` the config, summary and every history row.

    Returns 1 (and says so) when the folder holds no ``.wandb`` file.
    """
    parser = argparse.ArgumentParser(prog="python -m gpipe_lab.app.wandb_reader", description=main.__doc__)
    parser.add_argument("directory", help="a run or sweep folder (searched recursively for *.wandb)")
    parser.add_argument("--key", default="train/loss", help="the history key to show per step (train/loss)")
    parser.add_argument("--json", action="store_true", help="config, summary and every history row as JSON")
    args = parser.parse_args(argv)
    files = find_run_files(args.directory)
    if not files:
        print(f"no .wandb file under {args.directory}")
        return 1
    for path in files:
        run = read_run(path)
        if args.json:
            print(json.dumps({"file": str(path), "config": run.config, "summary": run.summary,
                              "history": run.history}, indent=2, default=str))
            continue
        summary = {k: v for k, v in run.summary.items() if not k.startswith("_") and not isinstance(v, dict)}
        print(f"{path} (run {run.name or '?'}, group {run.group or '-'}{resume_note(run)}): "
              f"{len(run.history)} history rows")
        print("  summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in sorted(summary.items())))
        print("\n".join(history_lines(run, args.key)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

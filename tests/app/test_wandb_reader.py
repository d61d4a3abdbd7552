"""The offline .wandb reader on a hand-made log: FULL records and a record split across blocks."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from gpipe_lab.app.wandb_reader import BARS, BLOCK_BYTES, iter_payloads, main, read_run


def _write_log(path: Path, payloads: list[bytes]) -> None:
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    for payload in payloads:
        rest, first = payload, True
        while True:
            room = BLOCK_BYTES - len(out) % BLOCK_BYTES
            if room < 7:
                out += b"\0" * room
                continue
            piece, rest = rest[: room - 7], rest[room - 7:]
            kind = (1 if not rest else 2) if first else (4 if not rest else 3)
            out += struct.pack("<IHB", zlib.crc32(piece), len(piece), kind) + piece
            first = False
            if not rest:
                break
    path.write_bytes(bytes(out))


def _history(step: int, **values: object) -> bytes:
    record = wandb_internal_pb2.Record()
    for key, value in {"_step": step, **values}.items():
        item = record.history.item.add()
        item.key = key
        item.value_json = json.dumps(value)
    return record.SerializeToString()


def test_reads_history_summary_and_split_records(tmp_path: Path) -> None:
    summary = wandb_internal_pb2.Record()
    item = summary.summary.update.add()
    item.key, item.value_json = "K", "4"
    big = _history(1, **{"train/loss": 0.5, "blob": "x" * 50_000})  # spans two blocks
    path = tmp_path / "run-test.wandb"
    _write_log(path, [_history(0, **{"train/loss": 1.0}), big, summary.SerializeToString()])
    assert len(list(iter_payloads(path))) == 3
    run = read_run(path)
    assert run.metric("train/loss") == [1.0, 0.5]
    assert run.summary["K"] == 4
    assert run.kinds == {"history": 2, "summary": 1}


def test_rejects_other_files(tmp_path: Path) -> None:
    path = tmp_path / "x.wandb"
    path.write_bytes(b"not a log")
    with pytest.raises(ValueError, match="not a wandb log"):
        read_run(path)


def test_the_command_line_shows_the_loss_per_step(tmp_path: Path, capsys) -> None:
    losses = [2.0 - 0.05 * step for step in range(30)]
    _write_log(tmp_path / "run-test.wandb", [_history(step, **{"train/loss": loss}) for step, loss in enumerate(losses)])
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "30 history rows" in out and "train/loss over 30 logged steps (min 0.55, max 2):" in out
    plot = out.splitlines()[3].strip()
    assert len(plot) == 30 and plot[0] == BARS[-1] and plot[-1] == BARS[0]  # falling loss, highest first
    assert "step      0  2" in out and "step     29  0.55" in out  # the first and the last step among the rows
    assert main([str(tmp_path), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["history"]) == 30

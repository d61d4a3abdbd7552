"""The offline .wandb reader on a hand-made log: FULL records and a record split across blocks."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from gpipe_lab.wandb_reader import BLOCK_BYTES, iter_payloads, read_run


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

"""Telling which peer went away, without a process group: process checks, the pid table, names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpipe_lab.pipeline.distributed.failure import ranks_in, who
from gpipe_lab.pipeline.distributed.liveness import PROC_KEY, PeerTable, host_id, process_gone


class DictStore:
    """The three store calls the table makes, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def child() -> subprocess.Popen:
    """A Python process that runs until its stdin closes."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "waitid"), reason="needs os.waitid")
def test_process_gone_running_zombie_and_reaped() -> None:
    assert not process_gone(os.getpid())
    proc = child()
    try:
        assert not process_gone(proc.pid)
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie
    assert process_gone(proc.pid)
    proc.wait(timeout=30)
    assert process_gone(proc.pid)


@pytest.mark.timeout(60)
def test_peer_table_names_only_ranks_whose_process_ended() -> None:
    store = DictStore()
    proc = child()
    try:
        table = PeerTable(store, 0, 3)
        table.refresh()
        assert table.pids == {}  # ranks 1 and 2 have not registered yet
        store.set(PROC_KEY.format(1), f"{proc.pid} {host_id()}")
        store.set(PROC_KEY.format(2), f"{os.getpid()} another-host")  # not comparable: never named
        assert table.gone([1, 2]) == []
        assert table.pids == {1: proc.pid}
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)
    assert table.gone([1, 2]) == [1]
    assert table.gone([2]) == []


def test_rank_names_round_trip() -> None:
    assert who([1]) == "rank 1" and who([1, 3]) == "ranks 1, 3"
    assert ranks_in("ranks 1, 3 went away (seen by rank 0 in stage 0, sharing the loss)") == [1, 3]
    assert ranks_in("rank 2 failed in stage 2, forward of micro-batch 2: ValueError: boom") == [2]
    assert ranks_in("something else") == []

"""Telling which peer went away, without a process group: process checks, the pid table, names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpipe_lab.pipeline.distributed.failure import AbortChannel, ranks_in, who
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


class Server:
    """A store server: what every client sees once the server has applied it."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}


class LaggingClient:
    """One connection to ``Server`` with TCPStore's ordering: ``set`` returns before the server
    has applied it; a call that waits for a reply (``check``, ``get``) is answered after this
    connection's earlier requests, and a write of another connection shows only once applied."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.unapplied: list[tuple[str, bytes]] = []

    def set(self, key: str, value: str) -> None:
        self.unapplied.append((key, value.encode()))

    def _answer_after_earlier_requests(self) -> None:
        for key, value in self.unapplied:
            self.server.data[key] = value
        self.unapplied.clear()

    def get(self, key: str) -> bytes:
        self._answer_after_earlier_requests()
        return self.server.data[key]

    def check(self, keys: list[str]) -> bool:
        self._answer_after_earlier_requests()
        return all(k in self.server.data for k in keys)


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


@pytest.mark.timeout(60)
def test_a_survivor_that_announced_and_ended_is_not_named_as_gone() -> None:
    """Rank 0 sees rank 1 gone, announces it and ends; rank 2 then finds ranks 0 and 1 ended.
    Rank 2 must read rank 0's announcement (naming rank 1 only), so the announcement has to be
    in the store before rank 0 can end, although the store acknowledges no write."""
    server = Server()
    first, third = LaggingClient(server), LaggingClient(server)
    announcer = AbortChannel(first, rank=0, stage=0, world_size=3)  # type: ignore[arg-type]
    reader = AbortChannel(third, rank=2, stage=1, world_size=3)  # type: ignore[arg-type]
    first.check([])  # the channels' own registrations are applied
    third.check([])
    ranks = {0: child(), 1: child()}  # stand-ins for the processes of ranks 0 and 1
    try:
        for rank, proc in ranks.items():
            server.data[PROC_KEY.format(rank)] = f"{proc.pid} {host_id()}".encode()
        server.data[PROC_KEY.format(2)] = f"{os.getpid()} {host_id()}".encode()
        ranks[1].stdin.close()  # type: ignore[union-attr]
        ranks[1].wait(timeout=30)  # rank 1 is killed
        first_error = announcer.explain("sharing the loss", [1, 2], None, "stage 0, sharing the loss")
        assert first_error.failed_ranks == (1,), first_error
    finally:
        for proc in ranks.values():
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
            proc.wait(timeout=30)  # rank 0 ends after raising its error
    error = reader.explain("sharing the loss", [0, 1], None, "stage 1, sharing the loss")
    assert error.failed_ranks == (1,), str(error)
    assert "rank 1 went away (seen by rank 0" in str(error), str(error)

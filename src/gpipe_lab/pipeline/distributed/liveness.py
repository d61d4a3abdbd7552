"""Which peer ranks went away: every rank's process, checked by the kernel of the same host.

When a link or a collective fails, gloo says "Connection closed by peer
[address]:port", not which rank is gone, and a collective may fail on every
survivor at once, before any of them could tell the others. Each rank therefore
writes its host and process id into the job's store (``gpipe/proc/<rank>``); once
every rank has done so, a survivor holds the table and, when something fails (or
while it waits), asks the kernel which of those processes have ended or are
exiting. A killed process is gone for good, so the answer never depends on timing.

Only processes on this host (same host name, boot and PID namespace) can be
checked; a peer elsewhere is named by the survivors on its own host, through the
abort channel, or else as the peer of the failed link.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

PROC_KEY = "gpipe/proc/{}"
_PF_EXITING = 0x4  # task flag: the process has begun to exit


def host_id() -> str:
    """Host name, boot and PID namespace: equal iff process ids of the two ranks are comparable."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:  # not Linux: the host name alone
        pass
    return "|".join(parts)


def process_gone(pid: int) -> bool:
    """True when process ``pid`` has ended, is a zombie or is exiting."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return _gone_by_signal(pid)
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ..., flags (7th)
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)


def _gone_by_signal(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


class PeerTable:
    """The process ids of the ranks on this host, read from the store once all have registered."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.host = host_id()
        self.pids: dict[int, int] = {}
        self._missing = [r for r in range(world_size) if r != rank]
        try:
            if store is not None:
                store.set(PROC_KEY.format(rank), f"{os.getpid()} {self.host}")
        except Exception:  # noqa: BLE001 - no store: failures are named by their link only
            self.store = None

    def refresh(self) -> None:
        """Read the other ranks' entries once all exist (one store round trip until then)."""
        if self.store is None or not self._missing:
            return
        keys = [PROC_KEY.format(r) for r in self._missing]
        try:
            if not self.store.check(keys):
                return
            for r, key in zip(self._missing, keys):
                pid, _, host = self.store.get(key).decode().partition(" ")
                if host == self.host:
                    self.pids[r] = int(pid)
        except Exception:  # noqa: BLE001 - the store host may be gone: keep what is known
            self.store = None
            return
        self._missing = []

    def gone(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` on this host whose process has ended or is exiting."""
        self.refresh()
        return sorted(r for r in set(ranks) if r in self.pids and process_gone(self.pids[r]))

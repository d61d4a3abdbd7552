"""A SIGKILLed rank is named by every survivor, whatever the survivor was doing.

One launch per moment. The focal survivor is held at its moment before the victim
dies: a layer that waits until the victim's process has ended (a pidfd, no sleep),
or ``dist.all_reduce`` patched to announce the collective in a store key that the
victim waits for before killing itself. Moments: a send (stage 0 sending an
activation to a dead stage 1), a receive (stage 1 waiting for an activation the dead
stage 0 never sends), the loss sharing that carries the non-finite verdict, and (with
data parallelism) the gradient all-reduce. For K=2 and for D=2 x K=2, every survivor
must raise ``PeerFailedError`` naming the victim and only it; the focal one also says
what it was doing and where (``[in stage k, ...]``). (The receive moment kills stage 0
before its first send: a dead peer's socket is reset, so data it sent just before may
never arrive, and the failing micro-batch would vary. The send moment holds stage 0
until its transport has closed every connection to the victim, so the send meets the
closed link at any speed rather than after stage 0 had moved on to receiving.)
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpipe_lab.pipeline.distributed import DistributedGPipe, PeerFailedError
from gpipe_lab.pipeline.distributed.spawn import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150),
              pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")]
TIMEOUT = 30.0  # the engine's: a survivor must stop on the failure, long before this
HELD = "test/held"
VICTIM_PORTS = "test/victim-ports"

# moment: (victim, focal survivor, what the focal survivor's error says, where it was)
MOMENTS = {
    "send": (1, 0, "sending to rank 1", "[in stage 0, forward of micro-batch"),
    "receive": (0, 1, "activation of micro-batch 0 from rank 0", "[in stage 1, forward of micro-batch 0]"),
    "loss": (1, 0, "sharing the loss", "[in stage 0, sharing the loss]"),
    "gradients": (1, 3, "averaging gradients", "[in stage 1, averaging gradients"),
}


def wait_gone(pid: int) -> None:
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], TIMEOUT)
    finally:
        os.close(fd)
    assert ready, f"process {pid} still alive after {TIMEOUT} s"


def _tcp_sockets() -> list[tuple[int, int]]:
    """(local port, remote port) of this process's TCP sockets, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    found.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)))
    return found


def publish_ports(store: dist.TCPStore) -> None:
    """The victim's local ports, for the focal survivor to recognise its connections to them."""
    store.set(VICTIM_PORTS, json.dumps(sorted({local for local, _ in _tcp_sockets()})))


def wait_disconnected(store: dist.TCPStore) -> None:
    """Until this process holds no connection to the victim's ports: gloo closes a link's
    socket once it has seen the peer close it, and a send on it raises from then on."""
    ports = set(json.loads(store.get(VICTIM_PORTS)))
    deadline, poll = time.monotonic() + TIMEOUT, threading.Event()
    while any(remote in ports for _, remote in _tcp_sockets()):
        assert time.monotonic() < deadline, f"still connected to the killed rank after {TIMEOUT} s"
        poll.wait(0.01)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Moment(nn.Module):
    """Identity; on forward call ``when`` runs ``action`` (hold the survivor, or kill the victim)."""

    def __init__(self, when: int, action) -> None:
        super().__init__()
        self.when, self.action, self.calls = when, action, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls == self.when and self.action is not None:
            self.action()
        self.calls += 1
        return x


def hook_all_reduce(store: dist.TCPStore, data_parallel: bool, victim: bool) -> None:
    """The step's first all-reduce on the world (loss sharing) or a data-parallel group (hooked
    after the pipe is built, whose groups' warm-up collectives come first): the focal
    survivor announces it, the victim waits for that announcement and dies instead."""
    real, first = dist.all_reduce, [True]

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if (group is not None) == data_parallel and first[0]:
            first[0] = False
            if victim:
                store.wait([HELD], timedelta(seconds=TIMEOUT))
                die()
            store.set(HELD, "1")
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


def moment_worker(rank: int, world: int, moment: str) -> dict:
    victim, focal, _, _ = MOMENTS[moment]
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=TIMEOUT))
    stage, K = rank % 2, 2
    holds = [None] * K
    if moment == "send" and rank == focal:  # stage 0, forward of micro-batch 1: the victim dies first
        holds[0] = lambda: (store.set(HELD, "1"), wait_gone(pids[victim]), wait_disconnected(store))
    if moment == "send" and rank == victim:  # stage 1, forward of micro-batch 0
        holds[1] = lambda: (publish_ports(store), store.wait([HELD], timedelta(seconds=TIMEOUT)), die())
    if moment == "receive" and rank == victim:  # stage 0 dies before sending anything
        holds[0] = die
    when = 1 - stage if moment == "send" else 0
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(K):
        layers += [nn.Linear(4, 4), nn.Tanh(), Moment(when, holds[k] if k == stage else None)]
    pipe = DistributedGPipe(nn.Sequential(*layers), balance=[3] * K, chunks=4, checkpoint="never", seed=0,
                            timeout=TIMEOUT, nonfinite="raise" if world == 2 else "skip")
    if moment in ("loss", "gradients") and rank in (victim, focal):  # the step's, not construction's
        hook_all_reduce(store, moment == "gradients", rank == victim)
    g = torch.Generator().manual_seed(1)
    try:
        pipe.train_step(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g), F.mse_loss)
    except PeerFailedError as exc:
        return {"type": "PeerFailedError", "message": str(exc), "ranks": list(exc.failed_ranks)}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "message": str(exc), "ranks": []}
    return {"type": None, "message": "the step completed", "ranks": []}


def check_moment(moment: str, world: int) -> None:
    victim, focal, what, where = MOMENTS[moment]
    results = run_local(moment_worker, world, args=(moment,), timeout=120, pg_timeout=TIMEOUT)
    assert results[victim].exitcode == -signal.SIGKILL, results[victim]
    for r in results:
        if r.rank == victim:
            continue
        assert r.exitcode == 0 and r.value is not None, f"rank {r.rank}: {r.error or 'killed at the deadline'}"
        assert r.value["type"] == "PeerFailedError", (r.rank, r.value)
        assert r.value["ranks"] == [victim], (r.rank, r.value)
        assert f"rank {victim} went away" in r.value["message"], (r.rank, r.value)
    message = results[focal].value["message"]
    assert what in message and where in message, message


@pytest.mark.parametrize("moment", ["send", "receive", "loss"])
def test_k2_survivor_names_the_killed_rank(moment: str) -> None:
    check_moment(moment, 2)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["send", "receive", "loss", "gradients"])
def test_d2_k2_every_survivor_names_the_killed_rank(moment: str) -> None:
    check_moment(moment, 4)

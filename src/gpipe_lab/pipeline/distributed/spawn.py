"""Run a function on N local processes joined by torch.distributed, always within a time limit.

    results = run_local(train, world_size=4, args=(cfg,), timeout=120)

Like torchrun on one machine: this process hosts the key-value store (so the
store survives any worker's death), each worker initializes the process group
from it, runs ``fn(rank, world_size, *args)`` and hands back the return value
or its exception. Workers end with ``os._exit`` (no shutdown wait on pending
gloo operations); any worker still alive at the deadline is killed. Used by
the tests and the benchmark; ``torchrun`` remains the launcher for real jobs.

Workers are forked from a forkserver that has imported torch once (per calling
process), so a launch does not pay torch's import in every rank; each worker
still starts from the caller's current environment variables and working
directory, as a spawned one would. Variables read by torch at import time
(``OMP_NUM_THREADS``, ...) take effect only with ``start_method="spawn"``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import BaseContext, ForkServerContext, SpawnContext
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpipe_lab.pipeline.distributed.resolve import process_group_device


@dataclass
class RankResult:
    """What one worker did: its exit code, return value or error text, and when it ended."""

    rank: int
    exitcode: int | None
    value: object = None
    error: str | None = None
    error_type: str | None = None
    ended: float | None = None  # seconds after launch (None: killed at the deadline)


PRELOAD = ["torch", "torch.distributed", "gpipe_lab.pipeline.distributed"]
START_METHODS = ("forkserver", "spawn")


def _worker(rank: int, fn: Callable[..., object], world_size: int, args: Sequence[object], port: int, backend: str,
            threads: int, outdir: str, pg_timeout: float, environ: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(threads)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    path = os.path.join(outdir, f"{rank}.pkl")
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout), **process_group_device(backend))
        value = fn(rank, world_size, *args)
        record = {"value": value}
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        record = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                  "error_type": type(exc).__name__}
        code = 1
    with open(path + ".tmp", "wb") as f:
        pickle.dump(record, f)
    os.replace(path + ".tmp", path)
    os._exit(code)


def add_preload(ctx: BaseContext, modules: Sequence[str]) -> None:
    """Add ``modules`` to the forkserver's preload list, read when the server starts (once per
    process). The list is process-wide: keep what others put there for their own forks."""
    from multiprocessing import forkserver

    current = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or [])
    ctx.set_forkserver_preload(current + [m for m in modules if m not in current])


def run_local(fn: Callable[..., object], world_size: int, args: Sequence[object] = (), timeout: float = 120.0,
              backend: str = "gloo", threads: int = 1, pg_timeout: float | None = None,
              start_method: str = "forkserver") -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` worker processes.

    ``fn`` must be importable (a module-level function). Returns one result per
    rank, in rank order, whatever happened; never waits longer than ``timeout``.

    Raises:
        ValueError: ``world_size`` < 1, or ``start_method`` not one of ``START_METHODS``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {list(START_METHODS)}, got {start_method!r}")
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = cast("ForkServerContext | SpawnContext", mp.get_context(start_method))  # one of START_METHODS'
    if start_method == "forkserver":
        add_preload(ctx, PRELOAD)
    environ, cwd = dict(os.environ), os.getcwd()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpipe-launch-") as outdir:
        procs = [ctx.Process(target=_worker, args=(r, fn, world_size, tuple(args), server.port, backend,
                                                   threads, outdir, pg_timeout or timeout, environ, cwd),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ended: dict[int, float] = {}
        deadline = start + timeout
        while len(ended) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.monotonic() - start
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        results = []
        for r, p in enumerate(procs):
            record: dict[str, Any] = {}
            path = os.path.join(outdir, f"{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    record = pickle.load(f)
            results.append(RankResult(r, p.exitcode, record.get("value"), record.get("error"),
                                      record.get("error_type"), ended.get(r)))
    del server
    return results

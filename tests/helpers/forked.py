"""``python -m MODULE ARGS`` for the tests, forked from a server that imported the heavy packages once.

A new interpreter pays about 7 CPU-seconds to import torch, Lightning and Hydra before the
app starts; the suite starts dozens. Here each run is a fresh process forked from a
multiprocessing forkserver that imported them once per test worker, then set up as
``python -m`` would: the caller's environment and working directory, the working directory
first on ``sys.path``, ``sys.argv``, fresh stdin, stdout and stderr (captured to files), and
``atexit`` handlers run at the end. What a test observes (exit code, output, files) is what
the real command gives; only what torch reads from the environment at import time
(``OMP_NUM_THREADS``, ...) is the server's (Lightning's rank, read from ``RANK`` at import, is set again).

    done = run_module("gpipe_lab.app.train", ["trainer=smoke"], cwd=tmp_path, timeout=240)
    done.returncode, done.stdout, done.stderr
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpipe_lab.pipeline.distributed.spawn import add_preload as _add_preload

# what the app imports, but not the module it runs (``python -m`` runs that fresh), nor wandb (its import
# makes a temporary folder that the first run to exit would remove for all)
PRELOAD = ["torch", "lightning.pytorch", "hydra", "omegaconf", "gpipe_lab.app.config.groups", "gpipe_lab.lightning",
           "gpipe_lab.lightning.callbacks", "gpipe_lab.models", "gpipe_lab.data", "gpipe_lab.app.config.environment",
           "gpipe_lab.app.run_console", "gpipe_lab.app.run_start", "gpipe_lab.app.suggest", "gpipe_lab.app.continuation"]
_CONTEXT = multiprocessing.get_context("forkserver")
_add_preload(_CONTEXT, PRELOAD)


def _text(fd: int, unbuffered: bool, line_buffering: bool) -> io.TextIOWrapper:
    """``sys.stdout``/``sys.stderr`` as the interpreter makes them (``PYTHONUNBUFFERED``: no buffer)."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8",
                            errors="backslashreplace", line_buffering=line_buffering, write_through=unbuffered)


def _child(module: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str | None,
           new_session: bool = False, sigint_ignored: bool = False) -> None:
    """Become ``python -m module *args``: output to ``out`` (and ``err``, or ``out`` too when None)."""
    if new_session:
        os.setsid()
    if sigint_ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "lightning.fabric" in sys.modules:  # its rank was read from RANK when the server imported it
        from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

        rank_zero_only.rank = _get_rank() or 0
    target = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # a fifo: blocks until the reader opens
    os.dup2(target, 1)
    os.close(target)
    if err is None:
        os.dup2(1, 2)
    else:
        target = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, 2)
        os.close(target)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout, sys.stderr = _text(1, unbuffered, line_buffering=False), _text(2, unbuffered, line_buffering=True)
    sys.path.insert(0, cwd)  # what ``python -m`` puts first
    sys.argv = [module, *args]  # runpy replaces argv[0] with the module's file
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (wandb, logging)
    finally:
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def run_module(module: str, args: Sequence[str], *, cwd: str | Path, env: Mapping[str, str] | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``python -m module *args`` in ``cwd`` with ``env`` (default: this process's); return what
    ``subprocess.run(..., capture_output=True, text=True)`` would.

    Raises:
        subprocess.TimeoutExpired: the run lasted longer than ``timeout`` (it is killed first).
    """
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="gpipe-forked-") as scratch:
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        proc = _CONTEXT.Process(target=_child, args=(module, list(args), str(cwd), env, out, err))
        proc.start()
        proc.join(timeout)
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join(10)
        stdout = Path(out).read_text(errors="replace") if os.path.exists(out) else ""
        stderr = Path(err).read_text(errors="replace") if os.path.exists(err) else ""
    command = [sys.executable, "-m", module, *args]
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, proc.exitcode, stdout, stderr)


def run_torchrun(nproc: int, module: str, args: Sequence[str], *, cwd: str | Path,
                 env: Mapping[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m module *args`` on this machine, its ranks forked like
    ``run_module``'s. As torchrun's agent does, this process hosts the key-value store the ranks
    join (``TORCHELASTIC_USE_AGENT_STORE``) and gives each rank torchrun's variables; the output
    is every rank's stdout, then every rank's stderr, in rank order; the exit status is the first
    non-zero one of a rank (torchrun's is 1).

    Raises:
        subprocess.TimeoutExpired: a rank ran longer than ``timeout`` (every rank is killed first).
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    base = dict(os.environ if env is None else env)
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
                "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    with tempfile.TemporaryDirectory(prefix="gpipe-torchrun-") as scratch:
        files = [(os.path.join(scratch, f"out{r}"), os.path.join(scratch, f"err{r}")) for r in range(nproc)]
        procs = [_CONTEXT.Process(target=_child, args=(module, list(args), str(cwd), {
            **base, **torchrun, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}, *files[r]))
            for r in range(nproc)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        timed_out = any(proc.is_alive() for proc in procs)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        stdout, stderr = ("".join(Path(f[i]).read_text(errors="replace") if os.path.exists(f[i]) else ""
                                  for f in files) for i in (0, 1))
    del store
    command = ["torchrun", "--nproc-per-node", str(nproc), "-m", module, *args]
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    codes = [proc.exitcode for proc in procs]
    return subprocess.CompletedProcess(command, next((1 for c in codes if c), 0), stdout, stderr)


class ForkedProcess:
    """A ``subprocess.Popen`` look-alike (``pid``, ``stdout``, ``poll``, ``wait``) for a forked
    ``python -m module``: stdout and stderr together on ``stdout``, read through a fifo."""

    def __init__(self, module: str, args: Sequence[str], *, cwd: str | Path, env: Mapping[str, str] | None = None,
                 new_session: bool = False, sigint_ignored: bool = False) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="gpipe-forked-")
        fifo = os.path.join(self._scratch.name, "console")
        os.mkfifo(fifo)
        self._proc = _CONTEXT.Process(target=_child, args=(module, list(args), str(cwd),
                                                            dict(os.environ if env is None else env), fifo, None,
                                                            new_session, sigint_ignored))
        self._proc.start()
        self.stdout = open(fifo, "rb")  # noqa: SIM115 - opens once the child has opened its end
        self.pid = self._proc.pid
        self.args = [sys.executable, "-m", module, *args]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return None if self._proc.is_alive() else self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (negative: the signal that ended it).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        self._proc.join(timeout)
        if self._proc.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self._scratch.cleanup()
        return self._proc.exitcode  # type: ignore[return-value]

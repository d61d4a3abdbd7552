"""The caller's side of the process mode: the stage processes of one pipe, and the executor
that drives them.

``ProcessExecutor`` replaces the core's executor. Each step of ``train_step`` or of a
forward without a graph: the caller's gradients go into the shared buffers, every stage
process gets its order (and the first rank's process the inputs), this process runs the
last rank itself, then reads every report: gradients back into the parameters' ``.grad``
(exactly as autograd would have left them: in place where a ``.grad`` was, a new tensor
where none was), timeline events, memory counts and deferred BatchNorm sample counts into
its own runtimes, so the core judges and ends the step as for threads. A ``pipe(x)`` whose
output is back-propagated, or inputs that need their gradient, run on threads.

Processes start on the first step (forkserver: torch is imported once per caller process),
each within ``timeout``; they are stopped by ``close``, when the pipe is collected, and
after a step that lost one (the next step starts new ones). A stage's exception is raised
here with its type, message and the stage process's traceback as a note.
"""

from __future__ import annotations

import functools
import multiprocessing.connection as mpc
import pickle
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, cast

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from gpipe_lab.pipeline.options import OptionError, PipelineOptions
from gpipe_lab.pipeline.processes.auto import AutoTrial
from gpipe_lab.pipeline.processes.channel import (
    ProcessChannel,
    StageProcessEnded,
    StageProcessLost,
    StageStopped,
)
from gpipe_lab.pipeline.processes.stage_process import (
    StageSetup,
    StepOrder,
    StepReport,
    deferred_norms,
    stage_main,
)
from gpipe_lab.pipeline.processes.wire import send_values
from gpipe_lab.pipeline.schedules import Schedule
from gpipe_lab.pipeline.stage.checkpointing import autocast_state
from gpipe_lab.pipeline.stage.replay_policy import generator_owners
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.channel import StepFeed
from gpipe_lab.pipeline.step.executor import Executor

PRELOAD = ["torch", "gpipe_lab.pipeline.processes.stage_process"]
#: seconds a stopping stage process may take before it is killed
STOP_S = 5.0
#: the least seconds stage processes may take to start (unpickling their layers; ``timeout`` if longer)
START_S = 120.0


def check_process_mode(options: PipelineOptions, devices: list[torch.device], looped: bool = True,
                       skips: bool = False) -> None:
    """Refuse what the process mode cannot run (CPU stages, no ``compile``, chunk j on rank j mod K
    (``looped``: not a V-shaped placement), no long skips (``skips``)).

    Raises:
        OptionError: naming ``local_stages``, the value and what it needs.
    """
    if not looped:
        raise OptionError(f"local_stages: 'processes' places chunk j on rank j mod K, but schedule "
                          f"{options.schedule!r} places its stages otherwise; use local_stages='threads'")
    if skips:
        raise OptionError("local_stages: 'processes' links neighbouring stages only, but the model has long "
                          "skips (skippable); use local_stages='threads'")
    if any(d.type != "cpu" for d in devices):
        raise OptionError(f"local_stages: 'processes' runs CPU stages only, got devices "
                          f"{[str(d) for d in devices]}; use local_stages='threads' on GPUs")
    if options.compile is not False:
        raise OptionError(f"local_stages: 'processes' does not compile stages, got compile={options.compile!r}; "
                          "use local_stages='threads' with compile")


def choose_local_stages(options: PipelineOptions, devices: list[torch.device], looped: bool = True,
                        skips: bool = False) -> str:
    """``threads``, ``processes`` or ``auto``: how ``options.local_stages`` runs on ``devices``
    (one per rank). One rank has nothing to run beside it: threads; ``auto`` where processes
    cannot run (a GPU stage, ``compile``, a V-shaped placement, long skips): threads.

    Raises:
        OptionError: ``processes`` where they cannot run (``check_process_mode``).
    """
    if options.local_stages == "threads" or len(devices) == 1:
        return "threads"
    if options.local_stages == "auto":
        try:
            check_process_mode(options, devices, looped, skips)
        except OptionError:
            return "threads"
        return "auto"
    check_process_mode(options, devices, looped, skips)
    return "processes"


class StageProcesses:
    """The stage processes of one pipe: ranks 0 .. K-2, each with its chunks (rank K-1 is the caller's)."""

    def __init__(self, runtimes: dict[int, StageRuntime], num_ranks: int, options: PipelineOptions,
                 threads: int | None) -> None:
        self.num_ranks, self.options, self.threads = num_ranks, options, threads
        self.ranks = list(range(num_ranks - 1))
        self.parts: dict[int, dict[int, nn.Sequential]] = {
            k: {j: r.module for j, r in runtimes.items() if j % num_ranks == k} for k in self.ranks}
        self.params = {j: list(r.module.parameters()) for j, r in runtimes.items() if j % num_ranks != num_ranks - 1}
        self.owners = generator_owners({j: r.device for j, r in runtimes.items()},
                                       [j % num_ranks for j in range(len(runtimes))], True)
        self.grad_buffers: dict[int, list[Tensor]] = {}
        self.channel: ProcessChannel | None = None
        self.serial = 0
        self.sent_schedules: set[int] = set()
        self._conns: dict[int, Connection] = {}
        self._procs: dict[int, BaseProcess] = {}
        self._layout: tuple[int, ...] = ()
        self.abort: Any = None  # the shared failure flag (``ProcessChannel``), made with the processes
        self._live: list[tuple[BaseProcess, Connection]] = []  # what the finalizer stops
        weakref.finalize(self, _stop_all, self._live)

    # ------------------------------------------------------------ life
    def _tensors(self) -> list[Tensor]:
        return [t for parts in self.parts.values() for part in parts.values()
                for t in (*part.parameters(), *part.buffers())]

    def ensure_started(self) -> None:
        """Start the processes, or new ones when one ended or a tensor they share was replaced.

        Raises:
            StageProcessLost: a process failed to start, or did not say it was ready within ``timeout``
                (at least ``START_S``).
            TypeError: a layer that does not pickle (a local class, a lambda attribute).
        """
        layout = tuple(t.data_ptr() for t in self._tensors())
        if self._procs and layout == self._layout and all(p.exitcode is None for p in self._procs.values()):
            return
        self.close()
        self._start()
        self._layout = tuple(t.data_ptr() for t in self._tensors())

    def _start(self) -> None:
        from gpipe_lab.pipeline.distributed.spawn import add_preload  # the forkserver's shared preload list

        ctx = mp.get_context("forkserver")
        add_preload(ctx, PRELOAD)
        for parts in self.parts.values():
            for j, part in parts.items():
                part.share_memory()  # the caller's own tensors move to shared memory, in place
                self.params[j] = list(part.parameters())  # as they are now (a parameter may have been replaced)
        # (torch's stub of ``share_memory_`` has no annotations)
        self.grad_buffers = {j: [torch.zeros_like(p).share_memory_() for p in params]  # type: ignore[no-untyped-call]
                             for j, params in self.params.items()}
        K = self.num_ranks
        abort = ctx.RawValue("i", 0)
        ends: dict[int, tuple[dict[int, Connection], dict[int, Connection]]] = {k: ({}, {}) for k in range(K)}
        for a in range(K):
            for b in {(a + 1) % K, (a - 1) % K} - {a}:
                reader, writer = ctx.Pipe(duplex=False)
                ends[a][0][b], ends[b][1][a] = writer, reader
        self.abort = abort
        self.sent_schedules = set()
        timeout = float(self.options.timeout)
        for k in self.ranks:
            mine, theirs = ctx.Pipe()
            setup = StageSetup(k, K, K * self.options.virtual_stages, self.parts[k],
                               {j: self.grad_buffers[j] for j in self.parts[k]}, self.options,
                               {j: self.owners[j] for j in self.parts[k]}, self.threads)
            proc = ctx.Process(target=stage_main, args=(theirs, *ends[k], abort), name=f"gpipe-stage-{k}",
                               daemon=True)
            proc.start()
            theirs.close()
            self._procs[k], self._conns[k] = proc, mine
            self._live.append((proc, mine))
            try:
                # over the pipe, not as an argument: the forkserver passes at most 256 descriptors with
                # a start, and each shared tensor's memory travels as one
                mine.send(("setup", setup))
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                self.close()
                raise TypeError(f"local_stages='processes': the layers of rank {k} cannot be sent to its stage "
                                f"process ({exc}); they must pickle (classes importable, no lambdas or local "
                                "classes), or use local_stages='threads'") from None
            for conn in (*ends[k][0].values(), *ends[k][1].values()):
                conn.close()  # the process holds its own ends: a pipe breaks when its process ends
        # the channel's receiver threads live until the processes end: they must not hold this object
        self.channel = ProcessChannel(K - 1, K, ends[K - 1][0], ends[K - 1][1], abort, self.threads, timeout,
                                      functools.partial(_check_alive, self._procs))
        deadline = time.monotonic() + max(timeout, START_S)
        for k in self.ranks:
            message = self._answer(k, deadline, "starting")
            if message[0] != "ready":
                self.close()
                raise _error_of(k, message[1])

    def _answer(self, k: int, deadline: float, doing: str) -> tuple[Any, ...]:
        """The next message of rank ``k``'s process, waiting until ``deadline``.

        Raises:
            StageProcessEnded: the process ended, or said nothing in time (the processes are then stopped).
        """
        conn, proc = self._conns[k], self._procs[k]
        ready = mpc.wait([conn, proc.sentinel], max(0.0, deadline - time.monotonic()))
        if conn in ready:
            try:
                return cast("tuple[Any, ...]", conn.recv())
            except (EOFError, OSError):
                pass
        self.close()
        if not ready:
            raise StageProcessEnded(f"the stage process of rank {k} said nothing in time while {doing}; "
                                    "the stage processes were stopped")
        hint = ("; a script that builds the pipe when imported needs `if __name__ == \"__main__\":` (stage "
                "processes start by importing the main module)") if doing == "starting" else ""
        raise StageProcessEnded(f"the stage process of rank {k} ended while {doing} "
                                f"(exit code {proc.exitcode}); the next step starts new stage processes{hint}")

    def close(self) -> None:
        """Stop the processes (bounded; kills what does not stop within ``STOP_S``)."""
        _stop_all(self._live)
        self._procs.clear()
        self._conns.clear()
        self.channel = None

    # ------------------------------------------------------------ a step
    def order(self, serial: int, schedule: Schedule, plan: Any, feed: StepFeed, sync_gradients: bool,
              timeout: float) -> None:
        """Send every process its order for step ``serial`` (the first rank's also its inputs).

        Raises:
            StageProcessLost: a process is gone.
        """
        shared_plan = replace(plan, loss_fn=None, loss_weights=[])
        sid = id(schedule)
        autocast = autocast_state()
        has_grad = self._push_grads()
        for k in self.ranks:
            parts = self.parts[k]
            inputs = feed.inputs if k == 0 and feed.inputs is not None else []
            order = StepOrder(serial, sid, None if sid in self.sent_schedules else schedule, shared_plan,
                              {j: tuple(m.training for m in part.modules()) for j, part in parts.items()},
                              {j: tuple(p.requires_grad for p in self.params[j]) for j in parts},
                              {j: has_grad[j] for j in parts}, sync_gradients, timeout, autocast, len(inputs),
                              feed.input_was_tensor)
            try:
                self._conns[k].send(("step", order))
                for values in inputs:
                    send_values(self._conns[k], None, values, False)
            except OSError as exc:
                self.close()
                raise StageProcessLost(f"the stage process of rank {k} is gone ({exc}); the next step "
                                       "starts new stage processes") from None
        self.sent_schedules.add(sid)

    def _push_grads(self) -> dict[int, tuple[bool, ...]]:
        """Each parameter's ``.grad`` into its shared buffer; which parameters have one."""
        has = {}
        for j, params in self.params.items():
            for p, buf in zip(params, self.grad_buffers[j]):
                if p.grad is not None:
                    buf.copy_(p.grad)
            has[j] = tuple(p.grad is not None for p in params)
        return has

    def reports(self, serial: int, timeout: float) -> dict[int, StepReport | BaseException]:
        """Every process's report of step ``serial``, or the error of one that gave none."""
        found: dict[int, StepReport | BaseException] = {}
        deadline = time.monotonic() + timeout
        for k in self.ranks:
            if k not in self._conns:
                found[k] = StageProcessLost(f"the stage process of rank {k} was stopped during the step")
                continue
            try:
                report = self._answer(k, deadline, f"running step {serial}")[1]
                while report.serial < serial:  # the report of a step whose caller was interrupted
                    report = self._answer(k, deadline, f"running step {serial}")[1]
            except StageProcessLost as lost:
                found[k] = lost
                continue
            found[k] = report
        return found

    def pull(self, report: StepReport, runtimes: dict[int, StageRuntime], peak_live: dict[int, int]) -> None:
        """Mirror ``report`` into this process: gradients, events, memory and BatchNorm counts."""
        for j, has in report.has_grad.items():
            for p, buf, got in zip(self.params[j], self.grad_buffers[j], has):
                if not got:
                    continue
                if p.grad is None:
                    p.grad = buf.clone()  # a new tensor, as autograd makes for a first gradient
                else:
                    p.grad.copy_(buf)  # autograd accumulated into the caller's own tensor
            runtime = runtimes[j]
            runtime.events, runtime.peak_bytes = report.events[j], report.peak_bytes[j]
            peak_live[j] = report.peak_live[j]
            for m, n in zip(deferred_norms(runtime.module), report.pending[j]):
                m.hand_over_pending(n)


def _check_alive(procs: dict[int, BaseProcess]) -> None:
    """Raise if one of ``procs`` (by rank) ended.

    Raises:
        StageProcessEnded: naming the rank and its exit code.
    """
    for k, proc in procs.items():
        if proc.exitcode is not None:
            raise StageProcessEnded(f"the stage process of rank {k} ended (exit code {proc.exitcode})")


def _stop_all(live: list[tuple[BaseProcess, Connection]]) -> None:
    """Ask every process to stop, then kill those still alive after ``STOP_S``; never raises."""
    for _, conn in live:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + STOP_S
    for proc, conn in live:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join(STOP_S)
        conn.close()
    live.clear()


def _error_of(k: int, report: StepReport) -> BaseException:
    """The exception a process reported (its own type when it pickled), with its traceback as a note."""
    error: BaseException | None = None
    if report.error is not None:
        try:
            error = pickle.loads(report.error)
        except Exception:  # noqa: BLE001 - a type that does not unpickle here: its text instead
            error = None
    if error is None:
        error = RuntimeError(report.error_text.strip().splitlines()[-1] if report.error_text else "failed")
    if hasattr(error, "add_note"):
        error.add_note(f"raised in the stage process of rank {k}:\n{report.error_text}")
    return error


def _secondary(error: BaseException) -> bool:
    """An error that only follows another's: a stop, a broken pipe (not the end of a process itself)."""
    return isinstance(error, StageStopped) or (isinstance(error, StageProcessLost)
                                               and not isinstance(error, StageProcessEnded))


class ProcessExecutor(Executor):
    """The core's executor in the process mode: the last rank here, the others in stage processes
    (with ``auto``: after its trial, if they were faster; see ``auto``)."""

    def __init__(self, local: Executor, num_ranks: int, options: PipelineOptions, threads: int | None,
                 mode: str = "processes") -> None:
        super().__init__(local.endpoint, local.runtimes)
        self.local = local  # threads: a pipe(x) graph, inputs that need their gradient
        self.processes = StageProcesses(self.runtimes, num_ranks, options, threads)
        #: ``processes``, ``threads`` (what ``auto`` chose) or ``auto`` (its trial is under way)
        self.mode = mode
        self.trial = AutoTrial() if mode == "auto" else None

    def run(self, schedule: Schedule, prepared: object, feed: StepFeed, sync_gradients: bool) -> None:
        """One step, on threads or processes as ``mode`` (or ``auto``'s trial) says.

        Raises:
            Exception: as ``_run_processes`` or the threads' executor.
        """
        plan = next(iter(self.runtimes.values())).plan
        graph_inputs = feed.inputs is not None and any(t.requires_grad for mb in feed.inputs for t in mb)
        eligible = feed.output_grads is None and not graph_inputs and (sync_gradients or not plan.grad_enabled)
        # auto's trial times training steps only; meanwhile a forward alone runs on threads
        timed = self.trial is not None and self.mode == "auto" and eligible and sync_gradients
        way = self.trial.next_way() if timed and self.trial is not None else self.mode
        start = time.perf_counter()
        if eligible and way == "processes":
            self._run_processes(schedule, prepared, feed, sync_gradients)
        else:
            self.local.run(schedule, prepared, feed, sync_gradients)
        if timed and self.trial is not None:
            choice = self.trial.record(way, time.perf_counter() - start)
            if choice is not None:
                self.mode = choice
                if choice == "threads":
                    self.processes.close()

    def _run_processes(self, schedule: Schedule, prepared: object, feed: StepFeed, sync_gradients: bool) -> None:
        """One step: the last rank here, the others in their processes (see the module docstring).

        Raises:
            Exception: the first failing stage's exception (its type, where it was raised, and
                the stage process's traceback as a note), once every process has reported.
            StageProcessLost: a stage process ended or stopped answering.
            PipelineTimeoutError: a wait of this process's rank lasted longer than the timeout.
        """
        plan = next(iter(self.runtimes.values())).plan
        pool = self.processes
        pool.ensure_started()
        assert pool.channel is not None  # made by ensure_started
        self.endpoint = channel = pool.channel
        timeout = channel.timeout = self.local.endpoint.timeout
        pool.serial += 1
        pool.abort.value = 0
        channel.serial = pool.serial
        pool.order(pool.serial, schedule, plan, feed, sync_gradients, timeout)
        failures: list[tuple[float, int, BaseException]] = []
        try:
            super().run(schedule, prepared, feed, sync_gradients)
        except BaseException as exc:  # noqa: BLE001 - raised below, unless a stage process failed first
            failures.append((time.monotonic(), self.num_stages - 1, exc))
        for k, report in pool.reports(pool.serial, timeout).items():
            if isinstance(report, BaseException):
                failures.append((time.monotonic(), k, report))
                continue
            pool.pull(report, self.runtimes, channel.peak_live)
            if report.error_text:
                failures.append((report.failed_at, k, _error_of(k, report)))
        if failures:
            first = min(failures, key=lambda f: (_secondary(f[2]), f[0]))
            raise first[2]

    def close(self) -> None:
        """Stop the stage processes (a later step starts new ones)."""
        self.processes.close()

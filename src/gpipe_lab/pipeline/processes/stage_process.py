"""A stage process: hosts one pipeline rank of the local transport's process mode.

Started once per pipe by ``pool.StageProcesses`` with its chunks, whose parameters and
buffers are the caller's own tensors in shared memory, and one shared gradient buffer per
parameter. It then runs one step per order (``StepOrder``) through the one executor over
a ``ProcessChannel``, and answers with a ``StepReport``: the gradients are in the shared
buffers, everything else the caller's process mirrors (timeline events, memory counts,
deferred BatchNorm sample counts) is in the report. It ends on ``stop``, or when the
caller's process is gone (its command pipe closes).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.devices.allocator import retain_freed_memory
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.pipeline.processes.channel import ProcessChannel, StageProcessLost, StageStopped
from gpipe_lab.pipeline.processes.wire import recv_values
from gpipe_lab.pipeline.schedules import Schedule
from gpipe_lab.pipeline.stage.batchnorm import DeferredBatchNorm
from gpipe_lab.pipeline.stage.checkpointing import AutocastState, autocast_as
from gpipe_lab.pipeline.stage.replay_policy import StepGuard
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.stage.stage_state import StepPlan
from gpipe_lab.pipeline.step.channel import StepFeed
from gpipe_lab.pipeline.step.core import configure_stages
from gpipe_lab.pipeline.step.executor import Executor


@dataclass
class StageSetup:
    """What a stage process is started with."""

    rank: int
    num_ranks: int
    num_stages: int
    parts: dict[int, nn.Sequential]  # its chunks, by stage index (tensors in shared memory)
    grad_buffers: dict[int, list[Tensor]]  # per chunk, one shared buffer per parameter
    options: PipelineOptions
    owners: dict[int, str]  # ``replay_policy.generator_owners`` of its chunks
    threads: int | None


@dataclass
class StepOrder:
    """One step for a stage process (the caller's state it cannot see is carried here)."""

    serial: int
    schedule_id: int
    schedule: Schedule | None  # sent with a schedule's first step only
    plan: StepPlan  # without the loss function and its weights: the last rank is the caller's
    modes: dict[int, tuple[bool, ...]]  # per chunk, ``training`` of each of its modules
    requires_grad: dict[int, tuple[bool, ...]]  # per chunk and parameter
    has_grad: dict[int, tuple[bool, ...]]  # per chunk and parameter: its shared buffer holds its .grad
    sync_gradients: bool
    timeout: float
    autocast: AutocastState
    inputs: int  # micro-batches of inputs that follow the order (the first rank's process)
    input_was_tensor: bool = True


@dataclass
class StepReport:
    """What a stage process did in one step."""

    serial: int
    events: dict[int, list[tuple[int, str, int, float, float]]] = field(default_factory=dict)
    peak_bytes: dict[int, int] = field(default_factory=dict)
    peak_live: dict[int, int] = field(default_factory=dict)
    has_grad: dict[int, tuple[bool, ...]] = field(default_factory=dict)
    pending: dict[int, list[int]] = field(default_factory=dict)  # DeferredBatchNorm samples, per layer
    error: bytes | None = None  # the pickled exception
    error_text: str = ""
    secondary: bool = False  # the error only follows another process's failure
    failed_at: float = 0.0


def deferred_norms(module: nn.Module) -> list[DeferredBatchNorm]:
    """``module``'s deferred BatchNorm layers, in the same order in every process."""
    return [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]


def error_report(report: StepReport, exc: BaseException) -> None:
    """Put ``exc`` (pickled when it can be) and its traceback into ``report``."""
    text = "".join(traceback.format_exception(exc))
    report.error_text, report.failed_at = text, time.monotonic()
    report.secondary = isinstance(exc, (StageStopped, StageProcessLost))
    try:
        report.error = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        report.error = None


class StageHost:
    """The stage process's side of the pipe: its runtimes, executor and step loop."""

    def __init__(self, setup: StageSetup, outgoing: dict[int, Connection], incoming: dict[int, Connection],
                 abort: Any) -> None:
        if setup.threads is not None:
            torch.set_num_threads(setup.threads)
        if setup.options.retain_cpu_memory:
            retain_freed_memory()  # as the caller's process: glibc keeps freed memory for the next step
        self.setup = setup
        self.parts = setup.parts
        self.params = {j: list(part.parameters()) for j, part in self.parts.items()}
        self.runtimes = {j: StageRuntime(j, setup.num_stages, part, torch.device("cpu"), int(setup.options.seed or 0))
                         for j, part in self.parts.items()}
        configure_stages(setup.options, self.runtimes, setup.owners)
        self.channel = ProcessChannel(setup.rank, setup.num_ranks, outgoing, incoming, abort, setup.threads,
                                      float(setup.options.timeout))
        self.executor = Executor(self.channel, self.runtimes)
        self.schedules: dict[int, Schedule] = {}

    def step(self, order: StepOrder, conn: Connection) -> StepReport:
        """Run ``order`` (reading its inputs from ``conn``); never raises for the step's own errors."""
        report = StepReport(order.serial)
        try:
            inputs = [recv_values(conn)[1] for _ in range(order.inputs)]
            if order.schedule is not None:
                self.schedules[order.schedule_id] = order.schedule
            self._take_state(order)
            for runtime in self.runtimes.values():
                runtime.begin(order.plan)
            self.channel.serial, self.channel.timeout = order.serial, order.timeout
            # an input micro-batch holds no None (only gradients do)
            feed = StepFeed(cast("list[tuple[Tensor, ...]]", inputs) if order.inputs else None,
                            order.input_was_tensor)
            guard = StepGuard([(r.replay, r.mode) for r in self.runtimes.values()])
            with autocast_as(order.autocast):
                self.executor.run(self.schedules[order.schedule_id], None, feed, order.sync_gradients)
            guard.check(order.plan.step)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's process
            error_report(report, exc)
        self._give_state(report)
        return report

    def _take_state(self, order: StepOrder) -> None:
        """The caller's modes, trainable flags and gradients, as the step must see them."""
        for j, part in self.parts.items():
            for m, training in zip(part.modules(), order.modes[j]):
                m.training = training
            buffers = self.setup.grad_buffers[j]
            for p, wanted, has, buf in zip(self.params[j], order.requires_grad[j], order.has_grad[j], buffers):
                p.requires_grad_(wanted)
                p.grad = buf if has else None  # autograd accumulates into the shared buffer in place

    def _give_state(self, report: StepReport) -> None:
        """Gradients into the shared buffers; the rest the caller mirrors into the report."""
        for j, runtime in self.runtimes.items():
            has = []
            for p, buf in zip(self.params[j], self.setup.grad_buffers[j]):
                grad = p.grad
                if grad is not None and grad is not buf:
                    buf.copy_(grad)  # a first gradient autograd made itself
                has.append(grad is not None)
                p.grad = None
            report.has_grad[j] = tuple(has)
            report.events[j] = runtime.events
            report.peak_bytes[j] = runtime.peak_bytes
            report.peak_live[j] = self.channel.peak_live.get(j, 0)
            norms = deferred_norms(runtime.module)
            # the caller's process commits or drops these sums
            report.pending[j] = [m.hand_over_pending(0) for m in norms]


def stage_main(conn: Connection, outgoing: dict[int, Connection], incoming: dict[int, Connection],
               abort: Any) -> None:
    """The stage process's body: read its ``StageSetup``, say ``ready`` (or the error), then serve steps."""
    try:
        host = StageHost(conn.recv()[1], outgoing, incoming, abort)
        conn.send(("ready", os.getpid()))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller's process
        report = StepReport(-1)
        error_report(report, exc)
        try:
            conn.send(("error", report))
        finally:
            os._exit(1)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the caller's process is gone
            os._exit(0)
        if message[0] != "step":
            break
        conn.send(("report", host.step(message[1], conn)))
    conn.send(("stopped", os.getpid()))
    os._exit(0)
